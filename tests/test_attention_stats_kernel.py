"""The Triton attention-statistics kernel (ops/attention_stats_triton.py) against the torch streaming path and the
fp64 materialised reference, as flash-linear-attention tests its kernels: odd lengths, several head dims, causal,
sliding window, softcap, GQA. On a CPU the kernel runs under Triton's interpreter (slow: sizes stay small); on a
CUDA machine the same tests run the compiled kernel. Skipped when triton is not importable."""
import importlib.util
import os

import pytest
import torch

from conftest import tiny_teacher, triton_interpreter_shims

from taylor_calibrate import ops
from taylor_calibrate.ops.attention_stats_torch import OUTPUTS, attention_stats, attention_stats_naive

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton); the torch path is tested in test_stats.py",
                allow_module_level=True)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it before anything imports triton
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

from taylor_calibrate.ops.attention_stats_triton import attention_stats_triton  # noqa: E402

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")]  # numpy, in the interpreter
if not CUDA:
    triton_interpreter_shims()


def _qk(B, H, Hkv, T, D, seed=0, temperature=1.5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g) * temperature
    k = torch.randn(B, Hkv, T, D, generator=g) * temperature
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype)


def _check(got, want, rtol=1e-4, atol=1e-4):
    assert set(got) == set(OUTPUTS)
    for name in OUTPUTS:
        a, b = got[name].cpu(), want[name].cpu()
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{name}: NaN pattern differs"
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{name}: {m}")


# T, head dim, (H, Hkv), window, softcap: every feature with odd lengths; 16-wide tiles so that T = 37 / 130 cross
# several query and key blocks (partial last blocks included)
CASES = [
    (1, 32, (2, 2), None, None),
    (37, 32, (4, 2), None, None),
    (130, 64, (4, 1), None, None),
    (130, 128, (2, 2), None, None),
    (37, 64, (4, 2), 7, None),  # window smaller than a block
    (130, 32, (2, 1), 40, None),  # window spanning blocks; the sink leaves it at t = 40
    (37, 32, (2, 2), None, 5.0),
    (130, 64, (4, 2), 20, 3.0),
    (37, 80, (2, 1), None, None),  # head dim not a power of two (padded tile)
]


@pytest.mark.parametrize("T,D,heads,window,softcap", CASES)
def test_kernel_equals_references(T, D, heads, window, softcap):
    H, Hkv = heads
    q, k = _qk(2, H, Hkv, T, D)
    scale = D ** -0.5
    got = attention_stats_triton(q, k, scale, window, softcap, block_m=16, block_n=16)
    _check(got, attention_stats_naive(q.cpu(), k.cpu(), scale, window, softcap))
    _check(got, attention_stats(q.cpu(), k.cpu(), scale, window, softcap, block=32))


# query tiles twice the key tiles: the kernel's split into masked edge blocks (key 0, the window's lower edge, the
# diagonal) and unmasked bulk blocks must give the same sums for every window position
@pytest.mark.parametrize("T,D,heads,window,softcap", [
    (130, 64, (4, 1), None, None), (37, 64, (4, 2), 7, None), (130, 32, (2, 1), 40, None),
    (130, 32, (2, 2), 70, None), (130, 64, (4, 2), 20, 3.0)])
def test_rectangular_tiles(T, D, heads, window, softcap):
    H, Hkv = heads
    q, k = _qk(1, H, Hkv, T, D, seed=5)
    got = attention_stats_triton(q, k, D ** -0.5, window, softcap, block_m=32, block_n=16)
    _check(got, attention_stats_naive(q.cpu(), k.cpu(), D ** -0.5, window, softcap))


def test_default_tiles_and_strided_inputs():
    """Production tiles (64-wide) and the (B, T, H, D).transpose(1, 2) views transformers hands to attention."""
    B, T, H, Hkv, D = 1, 100, 4, 2, 64
    q, k = _qk(B, H, Hkv, T, D, seed=3)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    k_view = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_view.is_contiguous()
    _check(attention_stats_triton(q_view, k_view, D ** -0.5, 33), attention_stats_naive(q.cpu(), k.cpu(), D ** -0.5, 33))


def test_bf16_inputs_within_twice_the_torch_bf16_error():
    """flash-attention's rule: against the fp64 reference on the same bf16-rounded inputs, the kernel's error is at
    most 2x that of the torch path (+ slack), which computes in fp32 from the same bf16 values."""
    q, k = _qk(1, 2, 1, 37, 64, seed=4, dtype=torch.bfloat16)
    ref = attention_stats_naive(q.cpu().double(), k.cpu().double(), 0.125)
    got = attention_stats_triton(q, k, 0.125, block_m=16, block_n=16)
    base = attention_stats(q.cpu(), k.cpu(), 0.125)
    for name in OUTPUTS:
        err = (got[name].cpu() - ref[name]).nan_to_num(0).abs().max().item()
        err_torch = (base[name] - ref[name]).nan_to_num(0).abs().max().item()
        assert err <= 2 * err_torch + 1e-4, (name, err, err_torch)


def test_dominant_sink_keeps_sink_dropped_statistics():
    """Where the torch path underflows (the xfail in test_stats.py), the kernel stays exact: its loop has its own
    running max over the non-sink keys and folds key 0 in afterwards."""
    T = 20
    q = torch.zeros(1, 1, T, 16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, T, 16)
    k[..., 0, 0] = 120.0  # sink score 120, every other key 0
    st = attention_stats_triton(q.to(DEVICE), k.to(DEVICE), 1.0, block_m=16, block_n=16)
    t = torch.arange(1, T).float()
    torch.testing.assert_close(st["distance_nosink"][0, 0, 1:].cpu(), (t - 1) / 2)
    torch.testing.assert_close(st["entropy_nosink"][0, 0, 1:].cpu(), torch.log(t))
    torch.testing.assert_close(st["sink"][0, 0].cpu(), torch.ones(T))


def test_large_scores_stay_finite():
    q, k = _qk(1, 2, 2, 40, 32, seed=1, temperature=2.0)
    q[..., 0], k[..., 0] = 10.0, 10.0  # scores about 100: exp overflows fp32 without the running max
    got = attention_stats_triton(q, k, 1.0, 5, block_m=16, block_n=16)
    for name in OUTPUTS:
        assert not torch.isinf(got[name]).any(), name
    _check(got, attention_stats_naive(q.cpu(), k.cpu(), 1.0, 5), rtol=1e-4, atol=2e-4)


def test_bad_input_is_refused():
    q, k = _qk(1, 4, 3, 8, 32)
    with pytest.raises(ValueError, match="GQA"):
        attention_stats_triton(q, k, 1.0)
    q, k = _qk(1, 2, 1, 8, 32)
    with pytest.raises(ValueError, match="window"):
        attention_stats_triton(q, k, 1.0, window=0)
    with pytest.raises(TypeError, match="fp64"):
        attention_stats_triton(q.double(), k.double(), 1.0)
    with pytest.raises(ValueError, match="block_m >= block_n"):
        attention_stats_triton(q, k, 1.0, block_m=16, block_n=32)


def test_dispatcher(monkeypatch):
    """auto: triton for CUDA tensors, torch for CPU tensors (never the interpreter); an explicit 'triton' on CPU
    tensors fails loudly unless the interpreter is on; unknown names are refused."""
    monkeypatch.setattr(ops, "_stats_resolved", {})
    assert ops.resolve_stats_backend("auto", "cpu") == "torch"
    assert ops.resolve_stats_backend("torch", DEVICE) == "torch"
    assert ops.resolve_stats_backend("triton", DEVICE) == "triton"  # CUDA, or CPU under the interpreter
    with pytest.raises(ValueError, match="unknown"):
        ops.resolve_stats_backend("cuda", "cpu")
    if CUDA:
        assert ops.resolve_stats_backend("auto", "cuda") == "triton"
    monkeypatch.setattr(ops, "_stats_resolved", {})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="unavailable"):
        ops.resolve_stats_backend("triton", "cpu")
    monkeypatch.setattr(ops, "_stats_resolved", {})
    q, k = _qk(1, 2, 1, 9, 32)
    _check(ops.attention_stats(q, k, 0.2, backend="auto"), attention_stats_naive(q.cpu(), k.cpu(), 0.2))
    assert ops.attention_stats(q.double(), k.double(), 0.2)["entropy"].dtype == torch.float32  # fp64: torch path


@pytest.mark.parametrize("arch,over", [("qwen2", {}), ("mistral", {"sliding_window": 20}),
                                       ("gemma3_text", {"attn_logit_softcapping": 2.0})])
def test_collect_stats_same_with_either_backend(arch, over):
    """The teacher pass as the product runs it: GQA keys unexpanded, the teacher's windows and softcap, strided q/k."""
    from taylor_calibrate.stats import collect_stats

    model = tiny_teacher(arch, initializer_range=0.2, **over).to(DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, 45), generator=torch.Generator().manual_seed(0))
    a = collect_stats(model, ids, store_layers=[1], backend="torch", block=16)
    b = collect_stats(model, ids, store_layers=[1], backend="triton")
    for i, la in a.layers.items():
        lb = b.layers[i]
        assert la.window == lb.window
        for name in ("distance", "distance_floored", "entropy", "concentration_abs", "distance_nosink",
                     "entropy_nosink", "concentration_abs_nosink", "sink_mass", "head_rms"):
            torch.testing.assert_close(getattr(lb, name), getattr(la, name), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"layer {i} {name}: {m}")
    torch.testing.assert_close(b.head_outputs[1], a.head_outputs[1])


def test_autotune_candidates():
    """The tiles the GPU autotuner may pick keep BLOCK_M a multiple of BLOCK_N (the loop's diagonal split), and wide
    heads (D > 128) keep only tiles whose shared memory fits."""
    from taylor_calibrate.ops.attention_stats_triton import _configs, _prune

    configs = _configs()
    assert all(c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0 for c in configs)
    assert _prune(configs, {}, HEAD_DIM=128) == configs
    wide = _prune(configs, {}, HEAD_DIM=256)
    assert wide and all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64 for c in wide)
