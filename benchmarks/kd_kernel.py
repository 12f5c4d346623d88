"""The distillation loss over one chunk of logits: the compiled PyTorch reference (`ops/kd_torch.py`) against the
Triton kernel (`ops/kd_triton.py`), forward KL with its gradient (the default loss), at a chunk of `--rows` tokens of
each `--vocab`: time per chunk, the bandwidth that time implies (two reads of both logits and one write of the
gradient), and the largest differences of the two outputs. Prints JSON and a table.

    python benchmarks/kd_kernel.py --out /tmp/kd_kernel.json     # 4096 tokens of SmolLM2's and Gemma 3's vocabularies
    python benchmarks/kd_kernel.py --tiny --device cpu           # check the script (the reference only, uncompiled)
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from perf_common import ints

from taylor_calibrate import ops
from taylor_calibrate.ops.kd_torch import kd_chunk
from taylor_calibrate.results import record
from taylor_calibrate.teacher import resolve_device


def timed(fn, args, reps: int, device) -> float:
    for _ in range(3):  # compile and warm up
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096, help="tokens per chunk (--train.kl_chunk)")
    ap.add_argument("--vocab", default="49152,262144", help="vocabulary sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="a small shape (CPU check of the script)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tiny:
        a.rows, a.vocab, a.reps = 8, "300", 2
    device = resolve_device(a.device)
    kernels = {"torch": torch.compile(kd_chunk) if device.type == "cuda" else kd_chunk}
    if ops.resolve_loss_backend("auto", device) == "triton":
        kernels["triton"] = ops.loss_kernel("triton", device, False)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for V in ints(a.vocab):
        g = torch.Generator(device=device).manual_seed(0)
        s = (torch.randn(a.rows, V, device=device, generator=g) * 3).to(dtype)
        t = (torch.randn(a.rows, V, device=device, generator=g) * 3).to(dtype)
        args = (s, t, None, None, 1.0, 1.0 / a.rows, 0.0, None, None, True)
        outs = {}
        for name, fn in kernels.items():
            ms = timed(fn, args, a.reps, device) * 1e3
            outs[name] = fn(*args)
            moved = 5 * s.numel() * s.element_size()  # s and t read twice, the gradient written once
            rows.append({"vocab": V, "kernel": name, "ms_per_chunk": ms, "gb_per_s": moved / ms / 1e6})
        if "triton" in outs:
            (k0, _, g0), (k1, _, g1) = outs["torch"], outs["triton"]
            rows[-1].update(kl_rel_diff=abs((k1 - k0) / k0).item(),
                            grad_max_abs_diff=(g1.float() - g0.float()).abs().max().item(),
                            grad_max_abs=g0.float().abs().max().item())
            rows[-1]["speedup"] = rows[-2]["ms_per_chunk"] / rows[-1]["ms_per_chunk"]
    res = {"what": " ".join(__doc__.split("\n\n")[0].split()), "device": str(device), "dtype": str(dtype),
           "rows_per_chunk": a.rows, "rows": rows}
    if a.out:
        res.update(record(a.out, res, a))
    print(json.dumps(res, indent=1))
    print("| vocab | kernel | ms per chunk | GB/s | speedup |\n|---|---|---|---|---|")
    for r in rows:
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        print(f"| {r['vocab']:,} | {r['kernel']} | {r['ms_per_chunk']:.3f} | {r['gb_per_s']:,.0f} | {sp} |")


if __name__ == "__main__":
    sys.exit(main())
