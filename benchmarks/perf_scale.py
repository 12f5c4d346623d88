"""The default conversion (statistics, phase 1, phase 2, held-out evaluation; full profile) per stage, with peak
memory, for a Qwen2.5-1.5B shape and a Qwen3-8B shape, teachers built in memory (convert.convert).

    python benchmarks/perf_scale.py --out perf_scale.json
    python benchmarks/perf_scale.py --tiny --device cpu --tokenizer bytes --out /tmp/perf_scale.json
"""
from __future__ import annotations

import json

import torch

# perf_common.py sits beside this script (its directory is on sys.path when it runs)
from perf_common import allocated, build_teacher, free, load_tokenizer, mb, run_benchmark

from taylor_calibrate.config import AlignArgs, ConvertArgs, DataArgs
from taylor_calibrate.convert import Clock, convert, resolve_runtime
from taylor_calibrate.teacher import Teacher

DEFAULTS = {'scale_shapes': ('1p5b,8b', '1p5b,8b')}
"""Flag defaults: (full, --tiny)."""


def part_scale(a, device, dtype, res, save, tokenizer, tokenizer_name):
    detail = res.setdefault("scale", {})
    for shape in a.scale_shapes.split(","):
        free(device)
        before = allocated(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        clock = Clock()
        with clock("load_teacher"):  # building the random teacher
            model = build_teacher(shape, a.tiny, device, dtype)
        weights = None if before is None else allocated(device) - before
        teacher = Teacher(model=model, tokenizer=tokenizer, name=f"random {shape} shape")
        args = ConvertArgs(teacher=f"random-{shape}", device=device.type, dtype=str(dtype).replace("torch.", ""))
        if a.tiny:
            args.data = DataArgs(seq_len=64, calib_seqs=4, eval_seqs=4)
            args.phase2 = AlignArgs(steps=4, batch_size=2, log_every=2)
        if a.scale_align_steps is not None:
            args.phase2.steps = a.scale_align_steps
        row = {"shape": shape, "tokenizer": tokenizer_name}
        try:
            report = convert(args, teacher, resolve_runtime(args), clock).report
            peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else None
            row.update(wall_s=report["wall_s"], stage_s=report["stage_s"], peak_mem_mb=mb(peak), weights_mb=mb(weights),
                       profile=report["profile"], backend=report["backend"], dtype=report["dtype"],
                       gdn_layers=len(report["gdn_layers"]), calib_tokens=report["calib_tokens"],
                       eval_tokens=report["eval_tokens"], teacher_params=report["teacher_params"],
                       hybrid_params=report["hybrid_params"], teacher_ppl=report["teacher_ppl"],
                       hybrid_ppl=report["hybrid_ppl"],
                       align_steps=args.phase2.steps, align_batch=args.phase2.batch_size)
            res[f"convert_{shape}_s"] = report["wall_s"]
        except torch.OutOfMemoryError as e:
            row.update(wall_s=None, error=f"OOM: {str(e).splitlines()[0]}")
            res[f"convert_{shape}_s"] = None
        detail[shape] = row
        print(f"[scale] {shape}: " + json.dumps(row), flush=True)
        save()
        del teacher, model
        free(device)


def part(a, device, dtype, res, save):
    tokenizer, tokenizer_name = load_tokenizer(a.tokenizer)
    part_scale(a, device, dtype, res, save, tokenizer, tokenizer_name)


def add_arguments(ap):
    ap.add_argument("--tokenizer", default="embedded", choices=("embedded", "bytes"),
                    help="the embedded teacher's tokenizer (falls back to bytes if not installed)")
    ap.add_argument("--scale-align-steps", type=int, default=None,
                    help="alignment steps per layer (default: the profile's)")


def main(argv=None):
    return run_benchmark("perf_scale", __doc__, part, DEFAULTS, add_arguments, argv)


if __name__ == "__main__":
    main()
