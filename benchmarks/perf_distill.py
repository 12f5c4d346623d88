"""Recovery distillation of a 1.5B-shape hybrid (uniform, copy-only mixers) toward its teacher, as `distill` runs it
(fp32 master weights, bf16 autocast, forward KL over the 152K vocabulary): tokens/s after the first (untimed) step
and MFU (`distill.flops_per_token` over the GPU's peak bf16 FLOP/s); eager and / or compiled (--distill-modes;
compiled is the CUDA default, `--train.compile`).

    python benchmarks/perf_distill.py --distill-modes eager,compiled --out perf_distill.json
    python benchmarks/perf_distill.py --tiny --device cpu --out /tmp/perf_distill.json
"""
from __future__ import annotations

import json
import tempfile

import torch

# perf_common.py sits beside this script (its directory is on sys.path when it runs)
from perf_common import build_teacher, free, mb, profiled, run_benchmark

from taylor_calibrate.config import GDNConfig, TrainArgs
from taylor_calibrate.distill import distill
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.policy import gdn_layers, kept_layers

DEFAULTS = {'distill_batch': (16, 2), 'distill_micro': (8, 1), 'distill_seq': (2048, 32), 'distill_steps': (8, 3)}
"""Flag defaults: (full, --tiny)."""


def part_distill(a, device, dtype, res, save):
    """`distill.distill` on random tokens: throughput does not depend on the text or the init. With
    --distill-modes eager,compiled the same run again with `--train.compile true` (decoder layers and loss under
    torch.compile, the default on CUDA: list it last for the headline); with
    --distill-profile a torch.profiler table of two more steps (where the step's time goes)."""
    teacher = build_teacher("1p5b", a.tiny, device, dtype)
    cfg = teacher.config
    n = cfg.num_hidden_layers
    converted = gdn_layers(kept_layers("uniform", n, 4), n)
    B, T, steps = a.distill_batch, a.distill_seq, a.distill_steps
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, cfg.vocab_size, (B * steps, T), generator=gen)

    def run(compile_layers, n_steps=steps, desc="distill 1.5b"):
        student = convert_teacher(teacher, converted, GDNConfig()).float()  # fp32 masters, as run_distill loads them
        backend = student.set_backend("auto")
        args = TrainArgs(tokens=B * T * n_steps, batch_size=B, micro_batch_size=a.distill_micro, train="mixers",
                         eval_every=10 ** 9, save_every=10 ** 9, log_every=1, compile=compile_layers)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with tempfile.TemporaryDirectory() as tmp:
            report = distill(student, teacher, rows[:B * n_steps], rows[:1], args, tmp, resume=False,
                             eval_batch_size=1, desc=desc)
        row = {k: report[k] for k in ("steps", "tokens_per_step", "seq_len", "trained", "trained_params",
                                      "tokens_per_s", "flops_per_token", "mfu")}
        row.update(shape="qwen2.5-1.5b" + (" (tiny)" if a.tiny else ""), micro_batch=a.distill_micro,
                   gdn_backend=backend, gdn_layers=len(converted), timed_steps=n_steps - 1, compile=compile_layers,
                   peak_mem_mb=mb(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None)
        del student
        free(device)
        return row

    modes = a.distill_modes.split(",")
    if not modes or set(modes) - {"eager", "compiled"}:
        raise ValueError(f"--distill-modes {a.distill_modes!r}: a comma list of eager, compiled")
    for compiled in [m == "compiled" for m in modes]:
        row = run(compiled)
        # one row per mode; the last measured is the headline (list the default, compiled on CUDA, last)
        res["distill_runs"] = res.get("distill_runs", []) + [row]
        res["distill"] = row
        res["distill_mfu_1p5b"], res["distill_tokens_per_s_1p5b"] = row["mfu"], row["tokens_per_s"]
        print(f"[distill {'compiled' if compiled else 'eager'}] " + json.dumps(row), flush=True)
        save()
    if a.distill_profile:
        with profiled(device):
            run(modes[-1] == "compiled", 3, "distill 1.5b (profiled)")
    del teacher
    free(device)


def add_arguments(ap):
    ap.add_argument("--distill-modes", default="eager",
                    help="comma list of eager, compiled (--train.compile true, the CUDA default; the last one listed "
                         "gives the headline figure)")
    ap.add_argument("--distill-profile", action="store_true", help="print a torch.profiler table")


def main(argv=None):
    return run_benchmark("perf_distill", __doc__, part_distill, DEFAULTS, add_arguments, argv)


if __name__ == "__main__":
    main()
