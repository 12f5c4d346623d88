"""Peak GPU memory of the streaming statistics pass vs a plain teacher forward, as T grows (1K -> 8K).

The statistics keep O(T) accumulators per head and stream over key blocks, so the memory they add on top of the
teacher's own forward should stay flat in T (a materialised T x T attention would add H*T^2*4 bytes per layer).
Prints JSON + a table.

    python benchmarks/stats_memory.py --teacher smollm2-135m --out stats_memory.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from taylor_calibrate.results import record
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = load_teacher(a.teacher, "cuda", torch.bfloat16).model
    H = model.config.num_attention_heads
    rows = {}
    for T in map(int, a.lengths.split(",")):
        ids = torch.randint(0, model.config.vocab_size, (1, T), device="cuda")
        with torch.no_grad():
            peak_mb(lambda: model(input_ids=ids, use_cache=False))  # warm-up
            fwd_mb, fwd_s = peak_mb(lambda: model(input_ids=ids, use_cache=False))
        stats_mb, stats_s = peak_mb(lambda: collect_stats(model, ids.cpu(), batch_size=1, store_layers=()))
        rows[T] = {"forward_peak_mb": fwd_mb, "stats_peak_mb": stats_mb, "extra_mb": stats_mb - fwd_mb,
                   "naive_attention_matrix_mb": H * T * T * 4 / 2**20, "forward_s": fwd_s, "stats_s": stats_s}
    result = {"teacher": a.teacher, "device": torch.cuda.get_device_name(), "rows": rows,
              "command": f"python benchmarks/stats_memory.py --teacher {a.teacher} --lengths {a.lengths}"}
    print(json.dumps(result, indent=2))
    print("| T | forward peak MB | stats pass peak MB | extra MB | one T x T attention (fp32) MB | stats s / forward s |")
    print("|---|---|---|---|---|---|")
    for T, r in rows.items():
        print(f"| {T} | {r['forward_peak_mb']:.0f} | {r['stats_peak_mb']:.0f} | {r['extra_mb']:.0f} | "
              f"{r['naive_attention_matrix_mb']:.0f} | {r['stats_s'] / r['forward_s']:.1f} |")
    if a.out:
        record(a.out, result, a, command=result["command"])


if __name__ == "__main__":
    main()
