"""Distillation throughput of the SmolLM2-135M hybrid and a Qwen2.5-1.5B-shaped hybrid: plain KL against the chunked
KL (`--train.kl_chunk`), in one run. tokens/s, MFU and peak GPU memory per (shape, micro-batch, KL).

Random weights and random tokens (speed depends on neither): a uniform policy (keep_every 4), copy-only mixers,
`distill.distill` as the `distill` command runs it (fp32 master weights, bf16 autocast, trains the mixers,
torch.compile on CUDA by default), timed after the first step. A configuration that runs out of memory is recorded
as such. The JSON is rewritten after every row; a markdown twin goes beside it. `--tiny` runs tiny shapes (CPU).

    python benchmarks/distill_throughput.py --out benchmarks/results/performance/distill_throughput_h200.json
    python benchmarks/distill_throughput.py --tiny --device cpu --out /tmp/distill_throughput_tiny.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from perf_common import build_teacher, free, mb, profiled

from taylor_calibrate.config import GDNConfig, TrainArgs
from taylor_calibrate.distill import distill
from taylor_calibrate.results import record
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.policy import gdn_layers, kept_layers
from taylor_calibrate.teacher import resolve_device

NAMES = {"smollm2": "smollm2-135m", "1p5b": "qwen2.5-1.5b"}


def run(shape: str, micro: int, kl_chunk: int, a, device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = build_teacher(shape, a.tiny, device, dtype)
    cfg = teacher.config
    n = cfg.num_hidden_layers
    converted = gdn_layers(kept_layers("uniform", n, 4), n)
    B, T, steps = a.batch_size, a.seq_len, a.steps
    rows = torch.randint(0, cfg.vocab_size, (B * steps, T), generator=torch.Generator().manual_seed(0))
    student = convert_teacher(teacher, converted, GDNConfig()).float()
    backend = student.set_backend(a.backend)
    args = TrainArgs(tokens=B * T * steps, batch_size=B, micro_batch_size=micro, train="mixers", kl_chunk=kl_chunk,
                     eval_every=10 ** 9, save_every=10 ** 9, log_every=1, compile=a.compile)
    row = {"shape": NAMES[shape] + (" (tiny)" if a.tiny else ""), "kl": "chunked" if kl_chunk else "plain",
           "kl_chunk": kl_chunk, "micro_batch": micro, "batch": B, "seq_len": T, "gdn_layers": len(converted),
           "gdn_backend": backend, "vocab": cfg.vocab_size}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rep = distill(student, teacher, rows, rows[:1], args, tmp, resume=False, eval_batch_size=1,
                          desc=f"{shape} {row['kl']} micro {micro}")
        row.update({k: rep[k] for k in ("steps", "tokens_per_step", "tokens_per_s", "flops_per_token", "mfu")})
        row["timed_steps"] = steps - 1
    except torch.OutOfMemoryError:
        row["oom"] = True
    row["peak_mem_gb"] = mb(torch.cuda.max_memory_allocated()) / 1024 if device.type == "cuda" else None
    del student, teacher
    free(device)
    return row


def table(rows: list[dict]) -> str:
    out = ["| shape | KL | micro-batch | tokens/step | tokens/s | MFU | peak GB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tps = "OOM" if r.get("oom") else f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        gb = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") is not None else "-"
        out.append(f"| {r['shape']} | {r['kl']} | {r['micro_batch']} x {r['seq_len']} | "
                   f"{r['batch'] * r['seq_len']:,} | {tps} | {mfu} | {gb} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="smollm2,1p5b")
    ap.add_argument("--micro", default="smollm2:16,64;1p5b:8",
                    help="micro-batches (rows per forward) per shape, 'shape:m1,m2;shape:m'")
    ap.add_argument("--batch-size", type=int, default=64, help="rows per optimizer step")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per configuration (the first is untimed)")
    ap.add_argument("--kl-chunk", type=int, default=TrainArgs.kl_chunk, help="tokens per chunk of the chunked KL")
    ap.add_argument("--compile", default="auto", choices=("auto", "true", "false"))
    ap.add_argument("--backend", default="auto", help="GDN kernels: auto, torch, fla")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", action="store_true",
                    help="then 3 more steps of the first shape's last configuration under torch.profiler (top kernels)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check of the script)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = resolve_device(a.device)
    a.compile = None if a.compile == "auto" else a.compile == "true"
    if a.tiny:
        a.batch_size, a.seq_len, a.steps = min(a.batch_size, 4), min(a.seq_len, 32), min(a.steps, 3)
    micro = {s: [int(m) for m in ms.split(",")] for s, ms in (x.split(":") for x in a.micro.split(";"))}
    res = {"what": __doc__.splitlines()[0], "rows": []}
    for shape in a.shapes.split(","):
        for m in micro.get(shape, [a.batch_size]):
            m = min(m, a.batch_size)
            for chunk in (0, a.kl_chunk):
                row = run(shape, m, chunk, a, device)
                print(json.dumps(row), flush=True)
                res["rows"].append(row)
                if a.out:
                    res.update(record(a.out, res, a))
                    Path(a.out).with_suffix(".md").write_text(f"{res['what']}\n\n{table(res['rows'])}\n\n"
                                                              f"Command: `{res['command']}` at {res['commit']}\n")
    print(json.dumps(res, indent=1))
    print(table(res["rows"]))
    if a.profile:
        shape = a.shapes.split(",")[0]
        a.steps = 3
        with profiled(device):
            run(shape, min(micro.get(shape, [a.batch_size])[-1], a.batch_size), a.kl_chunk, a, device)


if __name__ == "__main__":
    sys.exit(main())
