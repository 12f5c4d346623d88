"""Phase 2 alone (the default alignment, full profile) on a SmolLM2-135M-shaped teacher (random weights: the
time does not depend on them), timed after a short untimed run has compiled and tuned every kernel
(`align_smollm2_warm_s`, the steady state beside perf_convert's cold figure).

    python benchmarks/perf_align.py --out perf_align.json
    python benchmarks/perf_align.py --tiny --device cpu --out /tmp/perf_align.json
"""
from __future__ import annotations

import json
import time

import torch

# perf_common.py sits beside this script (its directory is on sys.path when it runs)
from perf_common import build_teacher, free, profiled, run_benchmark, sync

from taylor_calibrate import ops
from taylor_calibrate.align import align_layers
from taylor_calibrate.calibrate import calibrated_mixers
from taylor_calibrate.config import AlignArgs, CalibArgs, GDNConfig, fill_align, load_profile
from taylor_calibrate.policy import gdn_layers, kept_layers
from taylor_calibrate.stats import attention_targets, collect_stats

DEFAULTS = {}
"""Flag defaults: (full, --tiny)."""


def part_align(a, device, dtype, res, save):
    """Phase 2 of the default conversion on a SmolLM2-135M-shaped teacher (random weights: the time does not depend
    on them), in a process whose kernels are already compiled and tuned by a short untimed run, so
    `align_smollm2_warm_s` is the steady state beside the convert part's cold figure (a fresh process pays fla's
    compilation and autotuning inside phase 1 and 2). --align-profile adds a torch.profiler table of 20 steps."""
    model = build_teacher("smollm2", a.tiny, device, dtype)
    n = model.config.num_hidden_layers
    converted = gdn_layers(kept_layers("uniform", n, 4), n)
    profile = "quick" if a.tiny else "full"
    prof = load_profile(profile)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (prof["data"]["calib_seqs"], prof["data"]["seq_len"]), generator=gen)
    stats = collect_stats(model, ids, store_layers=converted, store_device=device)
    targets = attention_targets(model, stats, converted)
    inputs = {i: stats.inputs[i] for i in converted}
    backend = ops.resolve_backend("auto")
    steps = a.scale_align_steps or prof["phase2"]["steps"]

    def run(n_steps):
        mixers, _ = calibrated_mixers(model, stats, converted, "taylor", CalibArgs(), GDNConfig(), backend)
        args = fill_align(AlignArgs(steps=n_steps), profile)
        sync(device)
        t = time.perf_counter()
        report = align_layers(mixers, inputs, targets, args)
        sync(device)
        return time.perf_counter() - t, report

    run(10)  # compiles and tunes every kernel of the step
    wall, report = run(steps)
    row = {"shape": "smollm2-135m" + (" (tiny)" if a.tiny else ""), "gdn_layers": len(converted), "steps": steps,
           "tokens_per_step": report["tokens_per_step"], "wall_s": wall, "train_s": report["train_s"],
           "step_ms": 1e3 * report["train_s"] / steps, "layer_group": report["layer_group"],
           "rel_mse_before": report["mean_rel_mse_before"], "rel_mse_after": report["mean_rel_mse_after"],
           "backend": backend}
    res["align"] = row
    res["align_smollm2_warm_s"] = wall
    print("[align] " + json.dumps(row), flush=True)
    save()
    if a.align_profile:
        with profiled(device):
            run(20)
    del model, stats, targets, inputs
    free(device)


def add_arguments(ap):
    ap.add_argument("--align-profile", action="store_true", help="print a torch.profiler table of 20 steps")
    ap.add_argument("--scale-align-steps", type=int, default=None, help="alignment steps (default: the profile's)")


def main(argv=None):
    return run_benchmark("perf_align", __doc__, part_align, DEFAULTS, add_arguments, argv)


if __name__ == "__main__":
    main()
