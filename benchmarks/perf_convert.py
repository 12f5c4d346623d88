"""The default conversion of a real teacher (--teacher, default the embedded SmolLM2-135M) as `taylor-calibrate
convert` runs it, in this process: wall time per stage (`align_smollm2_s` = phase 2, cold: a fresh process pays fla's
compilation and autotuning) and held-out perplexity of teacher and hybrid.

    python benchmarks/perf_convert.py --out perf_convert.json
    python benchmarks/perf_convert.py --tiny --device cpu --out /tmp/perf_convert.json
"""
from __future__ import annotations

import json

# perf_common.py sits beside this script (its directory is on sys.path when it runs)
from perf_common import free, ratio, run_benchmark

from taylor_calibrate.config import AlignArgs, ConvertArgs, DataArgs
from taylor_calibrate.convert import Clock, convert, resolve_runtime
from taylor_calibrate.teacher import DEFAULT_TEACHER, load_teacher

DEFAULTS = {}
"""Flag defaults: (full, --tiny)."""


def part_convert(a, device, dtype, res, save):
    """`taylor-calibrate convert --teacher <spec>` in this process (the CLI's defaults: full profile on a GPU)."""
    clock = Clock()
    with clock("load_teacher"):
        teacher = load_teacher(a.teacher, device, dtype)
    args = ConvertArgs(teacher=a.teacher, device=device.type, dtype=str(dtype).replace("torch.", ""))
    if a.tiny:
        args.data = DataArgs(seq_len=64, calib_seqs=4, eval_seqs=4)
        args.phase2 = AlignArgs(steps=4, batch_size=2, log_every=2)
        args.probe_samples = 2  # the heads policy's probe pass (and the reported retrieval) dominate a tiny run
    conv = convert(args, teacher, resolve_runtime(args), clock)
    report = conv.report
    row = {k: report[k] for k in ("wall_s", "stage_s", "profile", "backend", "dtype", "calib_tokens", "eval_tokens",
                                  "teacher_ppl", "hybrid_ppl")}
    row.update(teacher=a.teacher, ppl_ratio=ratio(report["hybrid_ppl"], report["teacher_ppl"]),
               align_steps=conv.args.phase2.steps, gdn_layers=len(report["gdn_layers"]))
    res["convert"] = row
    res["align_smollm2_s"] = report["stage_s"]["phase2_s"]
    print("[convert] " + json.dumps(row), flush=True)
    save()
    del teacher
    free(device)


def add_arguments(ap):
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="the teacher (as `convert --teacher`)")


def main(argv=None):
    return run_benchmark("perf_convert", __doc__, part_convert, DEFAULTS, add_arguments, argv)


if __name__ == "__main__":
    main()
