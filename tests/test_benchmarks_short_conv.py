"""benchmarks/short_conv.py: the GDN layer's short conv (K shifted fp32 products) equals the depthwise F.conv1d it
replaced, in value and in every gradient, also when decoding continues from a cache's conv state; and the script runs
end to end on a CPU and records its provenance."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from taylor_calibrate.model.mixers.gdn import GDNConfig
from taylor_calibrate.model.mixers.gdn.module import GatedDeltaNet

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from short_conv import conv1d_form  # noqa: E402


def _layer(K: int = 4) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(16, 2, 8, GDNConfig(conv_size=K), 0).double()
    for c in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
        torch.nn.init.normal_(c.weight)
    return layer


def test_shifted_products_equal_conv1d_in_value_and_gradients():
    for K in (2, 4):
        layer = _layer(K)
        x = [torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        grads = []
        for form in (conv1d_form, lambda m, *a: m._short_conv(*a, None)):
            layer.zero_grad()
            for t in x:
                t.grad = None
            out = form(layer, *x)
            w = torch.randn(2, 7, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
            (torch.cat(out, -1) * w).sum().backward()
            grads.append([o.detach() for o in out] + [t.grad for t in x]
                         + [c.weight.grad for c in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_decoding_from_the_cache_equals_the_whole_sequence():
    """Prefill 5 tokens, then 1 + 1 through the cache's conv state: the same outputs as one pass over all 7."""
    from transformers import DynamicCache, LlamaConfig

    layer = _layer()
    x = [torch.randn(1, 7, 16, dtype=torch.float64) for _ in range(3)]
    whole = torch.cat(layer._short_conv(*x, None), -1)
    cfg = LlamaConfig(num_hidden_layers=1, layer_types=["linear_attention"])
    cache = DynamicCache(config=cfg)
    parts = [torch.cat(layer._short_conv(*(t[:, a:b] for t in x), cache), -1) for a, b in ((0, 5), (5, 6), (6, 7))]
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-12, atol=1e-12)


def test_short_conv_script_tiny(tmp_path):
    out = tmp_path / "sc.json"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "short_conv.py"), "--tiny", "--device", "cpu",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [x["form"] for x in res["rows"]] == ["conv1d", "shifted"] and all(x["ms_fwd_bwd"] > 0 for x in res["rows"])
    assert res["max_abs_out_diff"] < 1e-5 and res["max_rel_weight_grad_diff"] < 1e-5
    assert res["commit"] and "args" in res and "env" in res


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("T", [7, 12])  # 14 tokens <= 16 hidden units: outputs concatenated; 24: weights
def test_one_qkv_matmul_equals_the_three_projections(bias, T):
    """`features` runs q|k|v as one matmul over the projections' rows (or, for few tokens, concatenates their
    outputs) and its conv on that: the same q, k, v as projecting apart and convolving them apart, and the same
    gradients for every projection."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(16, 2, 8, GDNConfig(), 0, qkv_bias=bias).double()
    for c in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
        torch.nn.init.normal_(c.weight)
    x = torch.randn(2, T, 16, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        layer.zero_grad()
        if fused:
            q, k, v = layer._conv(layer._qkv(x), None).split(16, -1)
        else:
            q, k, v = layer._short_conv(layer.q_proj(x), layer.k_proj(x), layer.v_proj(x), None)
        (torch.cat([q, k, v], -1) * torch.linspace(-1, 1, 48, dtype=torch.float64)).sum().backward()
        grads.append([q.detach(), k.detach(), v.detach()]
                     + [p.grad for m in (layer.q_proj, layer.k_proj, layer.v_proj) for p in m.parameters()])
    assert len(grads[0]) == 6 + 3 * bias
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
