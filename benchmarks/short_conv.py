"""The GDN layer's short causal conv as `F.conv1d` (a depthwise convolution, the form before) against K shifted
products (`GatedDeltaNet._short_conv` now), each followed by what follows it in the layer (SiLU on q|k, l2norm),
forward and backward, torch.compile'd as distillation compiles its layers: time per call and the largest difference.
Prints JSON and a table.

    python benchmarks/short_conv.py --out /tmp/short_conv.json          # a SmolLM2-135M layer, 64 x 1024 tokens
    python benchmarks/short_conv.py --tiny --device cpu                   # check the script
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from taylor_calibrate.model.mixers.gdn import GDNConfig
from taylor_calibrate.model.mixers.gdn.module import GatedDeltaNet
from taylor_calibrate.ops import l2norm
from taylor_calibrate.results import record
from taylor_calibrate.teacher import resolve_device


def conv1d_form(layer: GatedDeltaNet, q, k, v):
    """The layer's conv as it was: one depthwise F.conv1d over (B, 3C, T)."""
    T, K = q.shape[1], layer.cfg.conv_size
    x = torch.cat([q, k, v], dim=-1).transpose(1, 2)
    w = torch.cat([layer.q_conv1d.weight, layer.k_conv1d.weight, layer.v_conv1d.weight], dim=0)
    y = F.conv1d(F.pad(x, (K - 1, 0)), w.to(x.dtype), groups=w.shape[0])[..., -T:]
    return y.transpose(1, 2).split(q.shape[-1], dim=-1)


def shifted_form(layer: GatedDeltaNet, q, k, v):
    return layer._short_conv(q, k, v, None)


def after(conv, layer, q, k, v, H, D):
    """The conv and what the layer does next to q, k (SiLU, l2norm in fp32) and v."""
    q, k, v = conv(layer, q, k, v)
    B, T = q.shape[:2]
    q, k = (l2norm(F.silu(x).view(B, T, H, D).float()).to(v.dtype) for x in (q, k))
    return q, k, v


def timed(fn, inputs, reps: int, device) -> float:
    for _ in range(3):  # compile and warm up
        out = fn(*inputs)
        sum(o.float().sum() for o in out).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*inputs)
        sum(o.float().sum() for o in out).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--compile", default="auto", choices=("auto", "true", "false"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="a small shape (CPU check of the script)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.batch, a.seq_len, a.heads, a.head_dim, a.reps = 2, 32, 2, 8, 2
    device = resolve_device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = device.type == "cuda" if a.compile == "auto" else a.compile == "true"
    H, D = a.heads, a.head_dim
    torch.manual_seed(0)
    layer = GatedDeltaNet(H * D, H, D, GDNConfig(), 0).to(device)
    x = [torch.randn(a.batch, a.seq_len, H * D, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    rows, outs, grads = [], {}, {}
    for name, conv in (("conv1d", conv1d_form), ("shifted", shifted_form)):
        def fn(q, k, v, conv=conv):
            return after(conv, layer, q, k, v, H, D)
        run = torch.compile(fn) if compiled else fn
        layer.zero_grad()
        outs[name] = [o.detach().float() for o in run(*x)]
        s = timed(run, x, a.reps, device)
        layer.zero_grad()
        sum(o.float().sum() for o in run(*x)).backward()
        grads[name] = layer.q_conv1d.weight.grad.detach().float().clone()
        for t in x:
            t.grad = None
        rows.append({"form": name, "ms_fwd_bwd": s * 1e3})
    diff = max((p - q).abs().max().item() for p, q in zip(outs["conv1d"], outs["shifted"]))
    gdiff = ((grads["conv1d"] - grads["shifted"]).abs().max() / grads["conv1d"].abs().max()).item()
    res = {"what": " ".join(__doc__.split("\n\n")[0].split()), "device": str(device), "dtype": str(dtype),
           "compiled": compiled, "shape": [a.batch, a.seq_len, H, D], "rows": rows,
           "speedup": rows[0]["ms_fwd_bwd"] / rows[1]["ms_fwd_bwd"], "max_abs_out_diff": diff,
           "max_rel_weight_grad_diff": gdiff}
    if a.out:
        res.update(record(a.out, res, a))
    print(json.dumps(res, indent=1))
    print("| form | ms fwd+bwd |\n|---|---|\n" + "\n".join(f"| {r['form']} | {r['ms_fwd_bwd']:.3f} |" for r in rows))
    print(f"speedup {res['speedup']:.2f}x; max |out diff| {diff:.2e}; weight grad rel diff {gdiff:.2e}")


if __name__ == "__main__":
    sys.exit(main())
