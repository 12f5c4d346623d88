"""Peak memory of the streaming statistics pass vs a plain teacher forward, as T grows (1K -> 8K).

On CUDA: peak allocated GPU memory. On CPU: peak resident set size of a fresh subprocess per measurement.

The statistics keep O(T) accumulators per head and stream over key blocks, so the memory they add on top of the
teacher's own forward should stay flat in T (a materialised T x T attention would add H*T^2*4 bytes per layer).
Prints JSON + a table.

    python benchmarks/stats_memory.py --teacher smollm2-135m --out stats_memory.json
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from taylor_calibrate.stats import collect_stats
from taylor_calibrate.teacher import load_teacher


def peak_mb(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20, time.perf_counter() - t


def _cpu_child(teacher: str, T: int, what: str) -> None:
    """Run one measurement in this (fresh) process and print {peak_mb, s}: RSS after loading vs peak after running."""
    torch.manual_seed(0)
    model = load_teacher(teacher, "cpu", torch.float32).model
    ids = torch.randint(0, model.config.vocab_size, (1, T))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    with torch.no_grad():
        if what == "forward":
            model(input_ids=ids, use_cache=False)
        else:
            collect_stats(model, ids, batch_size=1, store_layers=())
    s = time.perf_counter() - t
    print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before, "s": s}))


def _cpu_measure(teacher: str, T: int, what: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, __file__, "--child", what, "--teacher", teacher, "--lengths", str(T)],
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    r = json.loads(out)
    return r["peak_mb"], r["s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _cpu_child(a.teacher, int(a.lengths), a.child)
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    rows = {}
    if not cuda:
        from transformers import AutoConfig  # noqa: F401

        for T in map(int, a.lengths.split(",")):
            fwd_mb, fwd_s = _cpu_measure(a.teacher, T, "forward")
            stats_mb, stats_s = _cpu_measure(a.teacher, T, "stats")
            rows[T] = {"forward_peak_mb": fwd_mb, "stats_peak_mb": stats_mb, "extra_mb": stats_mb - fwd_mb,
                       "forward_s": fwd_s, "stats_s": stats_s}
            print(json.dumps({T: rows[T]}), flush=True)
        H = load_teacher(a.teacher, "cpu", torch.float32).model.config.num_attention_heads
        for T, r in rows.items():
            r["naive_attention_matrix_mb"] = H * T * T * 4 / 2**20
        device = "cpu"
    else:
        model = load_teacher(a.teacher, "cuda", torch.bfloat16).model
        H = model.config.num_attention_heads
        device = torch.cuda.get_device_name()
    for T in (map(int, a.lengths.split(",")) if cuda else []):
        ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
        with torch.no_grad():
            peak_mb(lambda: model(input_ids=ids, use_cache=False))  # warm-up
            fwd_mb, fwd_s = peak_mb(lambda: model(input_ids=ids, use_cache=False))
        stats_mb, stats_s = peak_mb(lambda: collect_stats(model, ids.cpu(), batch_size=1, store_layers=()))
        rows[T] = {"forward_peak_mb": fwd_mb, "stats_peak_mb": stats_mb, "extra_mb": stats_mb - fwd_mb,
                   "naive_attention_matrix_mb": H * T * T * 4 / 2**20, "forward_s": fwd_s, "stats_s": stats_s}
    result = {"teacher": a.teacher, "device": device, "rows": rows,
              "command": f"python benchmarks/stats_memory.py --teacher {a.teacher} --lengths {a.lengths} "
                         f"--device {'cuda' if cuda else 'cpu'}"}
    print(json.dumps(result, indent=2))
    print("| T | forward peak MB | stats pass peak MB | extra MB | one T x T attention (fp32) MB | stats s / forward s |")
    print("|---|---|---|---|---|---|")
    for T, r in rows.items():
        print(f"| {T} | {r['forward_peak_mb']:.0f} | {r['stats_peak_mb']:.0f} | {r['extra_mb']:.0f} | "
              f"{r['naive_attention_matrix_mb']:.0f} | {r['stats_s'] / r['forward_s']:.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
