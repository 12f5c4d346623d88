"""The `convert` and `eval` stages: teacher -> policy -> hybrid -> held-out perplexity -> export.

Each stage function takes one argument dataclass (config.py), prints a table, writes `report.json` in its
output directory and returns the report dict. The README documents the report schema; keep keys stable.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from taylor_calibrate.config import ConvertArgs, EvalArgs
from taylor_calibrate.data import load_splits
from taylor_calibrate.evaluate import perplexity
from taylor_calibrate.export import REPORT, load_model, save_hybrid, write_json
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.ops import resolve_backend
from taylor_calibrate.policy import gdn_layers, kept_layers
from taylor_calibrate.teacher import load_teacher, resolve_device, resolve_dtype

log = logging.getLogger("taylor_calibrate")

INITS = ("copy",)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def run_convert(args: ConvertArgs) -> dict:
    """Convert a teacher into a hybrid, evaluate both on held-out text, save the hybrid."""
    if args.init not in INITS:
        raise ValueError(f"init={args.init!r} is not one of {INITS}")
    t0 = time.perf_counter()
    times = {}
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backend)

    teacher = load_teacher(args.teacher, device, dtype)
    n = teacher.model.config.num_hidden_layers
    kept = kept_layers(args.policy, n, args.keep_every)
    converted = gdn_layers(kept, n)
    times["load_teacher_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    splits = load_splits(args.data, teacher.tokenizer, args.data.seq_len, args.data.calib_seqs, args.data.eval_seqs)
    times["data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    teacher_eval = perplexity(teacher.model, splits.heldout, args.eval_batch_size, desc="teacher ppl")
    times["teacher_eval_s"] = time.perf_counter() - t

    t = time.perf_counter()
    torch.manual_seed(args.seed)
    hybrid = convert_teacher(teacher.model, converted, args.gdn, teacher_name=args.teacher, seed=args.seed)
    hybrid.set_backend(backend)
    times["convert_s"] = time.perf_counter() - t

    t = time.perf_counter()
    hybrid_eval = perplexity(hybrid, splits.heldout, args.eval_batch_size, desc="hybrid ppl")
    times["hybrid_eval_s"] = time.perf_counter() - t

    report = {
        "teacher": args.teacher,
        "init": args.init,
        "policy": args.policy,
        "layer_types": list(hybrid.config.layer_types),
        "kept_layers": kept,
        "gdn_layers": converted,
        "teacher_ppl": teacher_eval["ppl"],
        "hybrid_ppl": hybrid_eval["ppl"],
        "eval_tokens": hybrid_eval["tokens"],
        "teacher_params": _count(teacher.model),
        "hybrid_params": _count(hybrid),
        "backend": backend,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "stage_s": times,
        "args": asdict(args),
    }
    t = time.perf_counter()
    save_hybrid(hybrid, teacher.tokenizer, args.out)
    times["save_s"] = time.perf_counter() - t
    report["wall_s"] = time.perf_counter() - t0
    write_json(Path(args.out) / REPORT, report)

    print(f"\nconverted {args.teacher}: {len(converted)} of {n} layers -> GDN, kept attention {kept}")
    print_table([
        ("teacher ppl", f"{teacher_eval['ppl']:.3f}"),
        (f"hybrid ppl ({args.init})", f"{hybrid_eval['ppl']:.3f}"),
        ("eval tokens", str(hybrid_eval["tokens"])),
        ("params teacher / hybrid", f"{report['teacher_params'] / 1e6:.1f}M / {report['hybrid_params'] / 1e6:.1f}M"),
        ("backend / device / dtype", f"{backend} / {device} / {report['dtype']}"),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("output", str(Path(args.out) / REPORT)),
    ])
    return report


def run_eval(args: EvalArgs) -> dict:
    """Held-out perplexity of a saved model (and optionally of its teacher on the same text)."""
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backend)
    model, tokenizer = load_model(args.model, device, dtype)
    if hasattr(model, "set_backend"):
        model.set_backend(backend)
    if tokenizer is None:
        raise FileNotFoundError(f"{args.model} has no tokenizer files; save one beside the model")
    splits = load_splits(args.data, tokenizer, args.data.seq_len, 1, args.data.eval_seqs)
    report = {"model": args.model, "model_ppl": perplexity(model, splits.heldout, args.eval_batch_size)["ppl"]}
    if args.teacher:
        teacher = load_teacher(args.teacher, device, dtype)
        report["teacher"] = args.teacher
        report["teacher_ppl"] = perplexity(teacher.model, splits.heldout, args.eval_batch_size, "teacher ppl")["ppl"]
    report.update(eval_tokens=int(splits.heldout[:, 1:].numel()), backend=backend, wall_s=time.perf_counter() - t0,
                  args=asdict(args))
    out = Path(args.out or Path(args.model) / "eval")
    write_json(out / REPORT, report)
    print_table([(k, f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in report.items() if k != "args"])
    return report
