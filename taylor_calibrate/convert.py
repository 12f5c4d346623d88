"""The `convert` and `eval` stages: teacher -> policy -> hybrid -> held-out perplexity -> export; eval adds NIAH,
teacher agreement and lm-eval tasks on request.

Each stage function takes one argument dataclass (config.py), prints a table, writes `report.json` in its
output directory and returns the report dict. The README documents the report schema; keep keys stable.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch

from tqdm.auto import tqdm

from taylor_calibrate.align import RopedAttention, align_attention, align_layers
from taylor_calibrate.calibrate import calibrate_layer
from taylor_calibrate.config import CalibArgs, ConvertArgs, EvalArgs, apply_profile
from taylor_calibrate.data import load_splits
from taylor_calibrate.evaluate import agreement, import_lm_eval, lm_eval_tasks, perplexity
from taylor_calibrate.export import REPORT, load_model, save_hybrid, write_json
from taylor_calibrate.model.hybrid import convert_teacher, make_mixers
from taylor_calibrate.ops import resolve_backend
from taylor_calibrate.ops.fla import check_fla_backward
from taylor_calibrate.qwen3_5 import check_qwen3_form, fit_qk_norm, qwen3_form, target_gdn
from taylor_calibrate.policy import SCORED, bypass_scores, gdn_layers, greedy_scores, kept_layers
from taylor_calibrate.retrieval import niah_scores
from taylor_calibrate.stats import TeacherStats, collect_stats
from taylor_calibrate.teacher import Teacher, load_teacher, resolve_device, resolve_dtype

log = logging.getLogger("taylor_calibrate")

def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def attention_targets(teacher, stats: TeacherStats, layers, release: bool = False) -> dict[int, torch.Tensor]:
    """Teacher attention output after W_O for each layer: the phase 2 target (METHOD.md section 4). `release` drops
    each layer's stored head outputs once its target exists (phase 1 was their last reader), so the two never
    coexist for more than one layer."""
    out = {}
    for i in layers:
        o_proj = teacher.model.layers[i].self_attn.o_proj
        y = stats.head_outputs.pop(i) if release else stats.head_outputs[i]
        out[i] = torch.nn.functional.linear(y.to(o_proj.weight), o_proj.weight, o_proj.bias).to(y.device)
    return out


def store_device_for(model, rows: int, seq: int, layers, device: torch.device) -> torch.device:
    """Where the calibration rows' per-layer tensors live: on the GPU when inputs, head outputs and phase-2 targets
    of every stored layer take at most half of its free memory, else in host memory (phase 2 moves one batch at a
    time; phase 1 a few rows). 128 rows x 1024 tokens of a Qwen3-8B shape are ~80 GB of them."""
    if device.type != "cuda":
        return device
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    itemsize = next(model.parameters()).element_size()
    need = rows * seq * len(layers) * (2 * cfg.hidden_size + heads * head_dim) * itemsize
    free, _ = torch.cuda.mem_get_info(device)
    if need <= free / 2:
        return device
    log.info("calibration rows of %d layers need %.1f GB, more than half the GPU's free %.1f GB: stored in host "
             "memory", len(layers), need / 2 ** 30, free / 2 ** 30)
    return torch.device("cpu")


def calibrated_mixers(teacher, stats: TeacherStats | None, layers, init: str, calib: CalibArgs, gdn, backend: str,
                      seed: int = 0):
    """Copy-only mixers for `layers`, then phase 1 with method `init`."""
    mixers = make_mixers(teacher, layers, gdn, seed)
    for m in mixers.values():
        m.backend = backend
    report = {}
    if init != "copy":
        for i, m in tqdm(mixers.items(), desc=f"phase 1 ({init})", leave=False):
            rows = slice(0, calib.fit_rows)
            x, y = stats.inputs[i][rows].to(m.A_log.device), stats.head_outputs[i][rows].to(m.A_log.device)
            report[i] = calibrate_layer(m, stats.layers[i], x, y, init, calib)
    return mixers, report


def training_backend(backend: str, asked: str, needed: bool) -> str:
    """The backend phase 2 trains with: fla's backward refuses to run on some GPU/Triton pairs (Hopper with
    Triton < 3.7.1 and no tilelang). Asked for fla by name: fail with the fix; auto: say so and train on torch."""
    if not needed or backend != "fla":
        return backend
    problem = check_fla_backward()
    if problem is None:
        return backend
    if asked == "fla":
        raise RuntimeError(f"phase 2 trains through fla's kernels, whose backward does not run here: {problem}")
    log.warning("fla's backward does not run here, so phase 2 trains on the torch path (slower). %s", problem)
    return "torch"


def run_convert(args: ConvertArgs) -> dict:
    """Convert a teacher into a hybrid (phase 1 + phase 2 by default), evaluate both on held-out text, save it."""
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    training_backend(resolve_backend(args.backend), args.backend, args.align)  # fail before the (long) load
    teacher = load_teacher(args.teacher, device, resolve_dtype(args.dtype, device))
    return convert_loaded(args, teacher, t0)


def convert_loaded(args: ConvertArgs, teacher: Teacher, t0: float | None = None, save: bool = True) -> dict:
    """The convert stage from a loaded teacher on (an in-memory one works too: benchmarks/perf.py times random-weight
    teachers this way). `t0`: when the command started (load_teacher_s = time until now); `save=False` skips writing
    the model and report.json and returns the report."""
    t0 = time.perf_counter() if t0 is None else t0
    times = {}
    device = resolve_device(args.device)
    on = next(teacher.model.parameters()).device
    if on.type != device.type:
        raise ValueError(f"the teacher is on {on} but device={args.device!r} resolves to {device}; move it first")
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backend)
    profile = apply_profile(args, device.type)
    train_backend = training_backend(backend, args.backend, args.align)
    adapt = False  # --target qwen3_5 from a teacher without q/k norm: kept attention layers change form
    if args.target == "qwen3_5":
        check_qwen3_form(teacher.model.config)
        target_gdn(args.gdn, teacher.model.config)
        adapt = teacher.model.config.model_type != "qwen3"

    n = teacher.model.config.num_hidden_layers
    if args.policy not in SCORED:
        kept = kept_layers(args.policy, n, args.keep_every)
    times["load_teacher_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    d = args.data
    splits = load_splits(d, teacher.tokenizer, d.seq_len, d.calib_seqs, d.eval_seqs)
    times["data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    teacher_eval = perplexity(teacher.model, splits.heldout, args.eval_batch_size, desc="teacher ppl")
    times["teacher_eval_s"] = time.perf_counter() - t

    t = time.perf_counter()
    scores = None
    if args.policy == "bypass":
        scores = bypass_scores(teacher.model, splits.calib[:4], args.eval_batch_size)
        kept = kept_layers(args.policy, n, args.keep_every, scores)
    candidates = list(range(n)) if args.policy == "greedy" else gdn_layers(kept, n)
    stats = None
    stored = sorted(set(candidates) | set(kept if adapt and args.policy != "greedy" else []))
    if args.init != "copy" or args.align or args.policy == "greedy" or adapt:
        store = store_device_for(teacher.model, *splits.calib.shape, stored, device)
        stats = collect_stats(teacher.model, splits.calib, store_layers=stored, batch_size=args.eval_batch_size,
                              store_device=store)
    times["stats_s"] = time.perf_counter() - t

    t = time.perf_counter()
    mixers, p1 = calibrated_mixers(teacher.model, stats, candidates, args.init, args.calib, args.gdn, backend, args.seed)
    if args.policy == "greedy":
        scores = greedy_scores(teacher.model, mixers, splits.calib[:4], args.eval_batch_size)
        kept = kept_layers(args.policy, n, args.keep_every, scores)
    converted = gdn_layers(kept, n)
    mixers = {i: mixers[i] for i in converted}
    if stats is not None:  # greedy stored every layer's rows; phase 2 reads only the converted ones
        for i in set(candidates) - set(converted) - set(kept if adapt else []):
            del stats.inputs[i], stats.head_outputs[i]
    times["phase1_s"] = time.perf_counter() - t

    t = time.perf_counter()
    p2 = None
    if args.align:
        for m in mixers.values():
            m.backend = train_backend
        targets = attention_targets(teacher.model, stats, converted, release=True)
        p2 = align_layers(mixers, {i: stats.inputs[i] for i in converted}, targets, args.phase2)
    times["phase2_s"] = time.perf_counter() - t

    t = time.perf_counter()
    form, p2_attention = teacher.model, None
    if args.target == "qwen3_5":
        form = qwen3_form(teacher.model)
    if adapt:  # q/k RMSNorm added to the kept attention: closed-form start, then phase 2's alignment
        attns = {i: RopedAttention(form.model.layers[i].self_attn, form.model.rotary_emb) for i in kept}
        for i, m in attns.items():
            fit_qk_norm(m.attn, stats.inputs[i][:args.calib.fit_rows].to(device))
        if args.align:
            targets = attention_targets(teacher.model, stats, kept, release=True)
            p2_attention = align_attention(attns, {i: stats.inputs[i] for i in kept}, targets, args.phase2)
    times["target_s"] = time.perf_counter() - t

    hybrid = convert_teacher(form, converted, args.gdn, teacher_name=args.teacher, mixers=mixers)
    hybrid.set_backend(backend)
    t = time.perf_counter()
    hybrid_eval = perplexity(hybrid, splits.heldout, args.eval_batch_size, desc="hybrid ppl")
    times["hybrid_eval_s"] = time.perf_counter() - t

    report = {
        "teacher": args.teacher,
        "init": args.init,
        "align": args.align,
        "policy": args.policy,
        "layer_types": list(hybrid.config.layer_types),
        "kept_layers": kept,
        "gdn_layers": converted,
        "policy_scores": scores,
        "teacher_ppl": teacher_eval["ppl"],
        "hybrid_ppl": hybrid_eval["ppl"],
        "eval_tokens": hybrid_eval["tokens"],
        "calib_tokens": int(splits.calib.numel()),
        "phase1": p1,
        "phase2": p2,
        "target": args.target,
        "phase2_attention": p2_attention,
        "teacher_params": _count(teacher.model),
        "hybrid_params": _count(hybrid),
        "profile": profile,
        "backend": backend,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "stage_s": times,
        "args": asdict(args),
    }
    if save:
        t = time.perf_counter()
        save_hybrid(hybrid, teacher.tokenizer, args.out)
        times["save_s"] = time.perf_counter() - t
    report["wall_s"] = time.perf_counter() - t0
    if save:
        write_json(Path(args.out) / REPORT, report)

    init = f"{args.init}{' + align' if args.align else ''}"
    print(f"\nconverted {args.teacher}: {len(converted)} of {n} layers -> GDN ({args.policy}), kept attention {kept}")
    rows = [("teacher ppl", f"{teacher_eval['ppl']:.3f}"), (f"hybrid ppl ({init})", f"{hybrid_eval['ppl']:.3f}")]
    if p2 is not None:
        rows.append(("align rel-MSE before -> after", f"{p2['mean_rel_mse_before']:.3f} -> {p2['mean_rel_mse_after']:.3f}"))
    if p2_attention is not None:
        a = p2_attention
        rows.append(("kept attention + q/k norm, rel-MSE", f"{a['mean_rel_mse_before']:.3f} -> {a['mean_rel_mse_after']:.3f}"))
    print_table(rows + [
        ("eval / calib tokens", f"{hybrid_eval['tokens']} / {report['calib_tokens']} ({profile} profile)"),
        ("params teacher / hybrid", f"{report['teacher_params'] / 1e6:.1f}M / {report['hybrid_params'] / 1e6:.1f}M"),
        ("backend / device / dtype", f"{backend} / {device} / {report['dtype']}"),
        ("stage seconds", ", ".join(f"{k[:-2]} {v:.0f}" for k, v in times.items())),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("output", str(Path(args.out) / REPORT) if save else "(not saved)"),
    ])
    return report


def print_niah(scores: dict[str, dict]) -> None:
    """Accuracy table: one row per (task, model), one column per length ("-" where the length was skipped)."""
    first = next(iter(scores.values()))
    lengths = list(next(iter(first.values())))
    width = max(len(f"{task} ({who})") for who, s in scores.items() for task in s)
    print(f"  {'NIAH accuracy':<{width}}  " + "  ".join(f"{n:>6}" for n in lengths))
    for task in first:
        for who, s in scores.items():
            cells = ["     -" if s[task][n] is None else f"{s[task][n]:6.2f}" for n in lengths]
            print(f"  {f'{task} ({who})':<{width}}  " + "  ".join(cells))


def run_eval(args: EvalArgs) -> dict:
    """Held-out perplexity of a saved model (and optionally of its teacher on the same text); optionally
    long-context retrieval (--niah), agreement with the teacher (--agreement) and lm-eval tasks (--lm_eval_tasks)."""
    t0 = time.perf_counter()
    if args.lm_eval_tasks:
        import_lm_eval()  # fail before the slow parts, not after them
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backend)
    apply_profile(args, device.type)
    model, tokenizer = load_model(args.model, device, dtype)
    if hasattr(model, "set_backend"):
        model.set_backend(backend)
    if tokenizer is None:
        raise FileNotFoundError(f"{args.model} has no tokenizer files; save one beside the model")
    times = {}
    t = time.perf_counter()
    splits = load_splits(args.data, tokenizer, args.data.seq_len, 1, args.data.eval_seqs)
    report = {"model": args.model, "model_ppl": perplexity(model, splits.heldout, args.eval_batch_size)["ppl"]}
    teacher = None
    if args.teacher:
        teacher = load_teacher(args.teacher, device, dtype)
        report["teacher"] = args.teacher
        report["teacher_ppl"] = perplexity(teacher.model, splits.heldout, args.eval_batch_size, "teacher ppl")["ppl"]
    times["ppl_s"] = time.perf_counter() - t
    if args.agreement:
        t = time.perf_counter()
        report["agreement"] = agreement(model, teacher.model, splits.heldout, args.eval_batch_size)
        times["agreement_s"] = time.perf_counter() - t
    if args.niah:  # both models read the same prompts: built from the model's tokenizer
        niah = dict(tasks=args.niah_tasks, lengths=args.niah_lengths, samples=args.niah_samples, seed=args.niah_seed,
                    batch_size=args.eval_batch_size)
        t = time.perf_counter()
        report["niah"] = niah_scores(model, tokenizer, **niah, desc="model niah")
        times["niah_s"] = time.perf_counter() - t
        if teacher is not None:
            t = time.perf_counter()
            report["teacher_niah"] = niah_scores(teacher.model, tokenizer, **niah, desc="teacher niah")
            times["teacher_niah_s"] = time.perf_counter() - t
    if args.lm_eval_tasks:
        t = time.perf_counter()
        report["lm_eval"] = lm_eval_tasks(model, tokenizer, args.lm_eval_tasks, args.lm_eval_include,
                                          args.lm_eval_limit, args.eval_batch_size)
        times["lm_eval_s"] = time.perf_counter() - t
    report.update(eval_tokens=int(splits.heldout[:, 1:].numel()), backend=backend, stage_s=times,
                  wall_s=time.perf_counter() - t0, args=asdict(args))
    out = Path(args.out or Path(args.model) / "eval")
    write_json(out / REPORT, report)

    rows = [(k, f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in report.items()
            if k in ("model", "model_ppl", "teacher", "teacher_ppl", "eval_tokens", "backend")]
    if "agreement" in report:
        a = report["agreement"]
        rows += [("KL(teacher || model), nats/token", f"{a['kl']:.4f}"), ("top-1 agreement", f"{a['top1']:.4f}")]
    for task, metrics in report.get("lm_eval", {}).items():
        rows += [(f"lm_eval {task} {k}", f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in metrics.items()]
    rows += [("stage seconds", ", ".join(f"{k[:-2]} {v:.0f}" for k, v in times.items())),
             ("wall time", f"{report['wall_s']:.1f} s"), ("output", str(out / REPORT))]
    print_table(rows)
    if "niah" in report:
        print(f"\n  ({args.niah_samples} samples per cell, greedy, answer in the continuation)")
        print_niah({"model": report["niah"], **({"teacher": report["teacher_niah"]} if teacher is not None else {})})
    return report
