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

from taylor_calibrate.align import align_layers
from taylor_calibrate.calibrate import calibrate_layer
from taylor_calibrate.config import CalibArgs, ConvertArgs, EvalArgs, apply_profile
from taylor_calibrate.data import load_splits
from taylor_calibrate.evaluate import agreement, import_lm_eval, lm_eval_tasks, perplexity
from taylor_calibrate.export import REPORT, load_model, save_hybrid, write_json
from taylor_calibrate.model.hybrid import convert_teacher, converted_heads, make_mixers
from taylor_calibrate.ops import resolve_backend
from taylor_calibrate.ops.fla import check_fla_backward
from taylor_calibrate.policy import (RETRIEVAL, SCORED, bypass_scores, gdn_layers, greedy_scores, group_scores,
                                     kept_groups_of, kept_layers, layer_groups)
from taylor_calibrate.retrieval import answer_scores, calibration_probes, eval_probes, niah_scores, probe_length
from taylor_calibrate.stats import TeacherStats, collect_stats, head_subset, retrieval_heads
from taylor_calibrate.teacher import Teacher, load_teacher, resolve_device, resolve_dtype

log = logging.getLogger("taylor_calibrate")

def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def _columns(teacher, layer: int, kept_groups) -> torch.Tensor | None:
    """Head-output columns of a head-wise layer's GDN heads (None: the layer is converted whole)."""
    kept = (kept_groups or {}).get(layer, [])
    if not kept:
        return None
    D = teacher.config.head_dim if getattr(teacher.config, "head_dim", None) else \
        teacher.config.hidden_size // teacher.config.num_attention_heads
    return torch.tensor([h * D + j for h in converted_heads(teacher.config, kept) for j in range(D)])


def attention_targets(teacher, stats: TeacherStats, layers, release: bool = False,
                      kept_groups: dict[int, list[int]] | None = None) -> dict[int, torch.Tensor]:
    """Teacher attention output after W_O for each layer: the phase 2 target (METHOD.md section 4); of a head-wise
    layer, the part its GDN heads carry (their columns of W_O, no bias: the kept heads add the rest exactly).
    `release` drops each layer's stored head outputs once its target exists (phase 1 was their last reader), so the
    two never coexist for more than one layer."""
    out = {}
    for i in layers:
        o_proj = teacher.model.layers[i].self_attn.o_proj
        y = stats.head_outputs.pop(i) if release else stats.head_outputs[i]
        cols = _columns(teacher, i, kept_groups)
        if cols is None:
            out[i] = torch.nn.functional.linear(y.to(o_proj.weight), o_proj.weight, o_proj.bias).to(y.device)
        else:
            w = o_proj.weight[:, cols.to(o_proj.weight.device)]
            out[i] = torch.nn.functional.linear(y[..., cols.to(y.device)].to(w), w).to(y.device)
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
                      seed: int = 0, kept_groups: dict[int, list[int]] | None = None):
    """Copy-only mixers for `layers` (head-wise where `kept_groups` keeps some groups), then phase 1 with `init`."""
    mixers = make_mixers(teacher, layers, gdn, seed, kept_groups)
    for m in mixers.values():
        m.backend = backend
    report = {}
    if init != "copy":
        for i, m in tqdm(mixers.items(), desc=f"phase 1 ({init})", leave=False):
            rows = slice(0, calib.fit_rows)
            x, y = stats.inputs[i][rows].to(m.A_log.device), stats.head_outputs[i][rows].to(m.A_log.device)
            st, cols = stats.layers[i], _columns(teacher, i, kept_groups)
            if cols is not None:
                st, y = head_subset(st, converted_heads(teacher.config, kept_groups[i])), y[..., cols.to(y.device)]
            report[i] = calibrate_layer(m, st, x, y, init, calib)
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


def retrieval_probes(args, teacher: Teacher):
    """(length, evaluation probes) for the retrieval report; with a context too short for them, the policies that
    select by retrieval fail, the others report no retrieval (logged)."""
    try:
        length = probe_length(args.data.seq_len, teacher.model.config)
        while True:  # a tokenizer with many tokens per word needs longer prompts: double up to the context
            try:
                return length, eval_probes(teacher.tokenizer, length, args.probe_samples)
            except ValueError:
                longer = probe_length(2 * length, teacher.model.config)
                if longer == length:
                    raise
                length = longer
    except ValueError as e:
        if args.policy in RETRIEVAL:
            raise ValueError(f"policy {args.policy!r} scores heads on retrieval probes, which do not fit: {e}") from e
        log.warning("no retrieval report: %s", e)
        return None, []


def run_convert(args: ConvertArgs) -> dict:
    """Convert a teacher into a hybrid (phase 1 + phase 2 by default), evaluate both on held-out text, save it."""
    t0 = time.perf_counter()
    device = resolve_device(args.device)
    training_backend(resolve_backend(args.backend), args.backend, args.align)  # fail before the (long) load
    teacher = load_teacher(args.teacher, device, resolve_dtype(args.dtype, device))
    return convert_loaded(args, teacher, t0)


def convert_loaded(args: ConvertArgs, teacher: Teacher, t0: float | None = None, save: bool = True,
                   return_model: bool = False):
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

    n = teacher.model.config.num_hidden_layers
    kv = teacher.model.config.num_key_value_heads
    if args.policy not in SCORED + RETRIEVAL:
        kept = kept_layers(args.policy, n, args.keep_every, kv_budget=args.kv_budget)
    times["load_teacher_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    d = args.data
    splits = load_splits(d, teacher.tokenizer, d.seq_len, d.calib_seqs, d.eval_seqs)
    times["data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    teacher_eval = perplexity(teacher.model, splits.heldout, args.eval_batch_size, desc="teacher ppl")
    probe_len, probes = retrieval_probes(args, teacher)
    teacher_retrieval = answer_scores(teacher.model, probes) if probes else None
    times["teacher_eval_s"] = time.perf_counter() - t

    t = time.perf_counter()
    scores, kept_groups = None, None
    if args.policy == "bypass":
        scores = bypass_scores(teacher.model, splits.calib[:4], args.eval_batch_size)
        kept = kept_layers(args.policy, n, args.keep_every, scores, args.kv_budget)
    elif args.policy in RETRIEVAL:  # calibration needles in a calibration haystack: never the evaluation prompts
        words = tuple(teacher.tokenizer.decode(splits.calib[:8].flatten()).split())
        long = probe_length(4 * probe_len, teacher.model.config)  # retrieval heads far back too, not only near
        heads = retrieval_heads(teacher.model, [p for n in dict.fromkeys([probe_len, long]) for p in calibration_probes(
            teacher.tokenizer, words, length=n, samples=args.probe_samples)])
        groups = group_scores(heads, kv)
        scores = groups.tolist()
        if args.policy == "heads":
            kept_groups = kept_groups_of(groups, args.keep_every, args.kv_budget)
            kept = [i for i, g in kept_groups.items() if len(g) == kv]
        else:
            kept = kept_layers(args.policy, n, args.keep_every, groups.sum(1).tolist(), args.kv_budget)
    candidates = list(range(n)) if args.policy == "greedy" else (
        [i for i, g in kept_groups.items() if len(g) < kv] if kept_groups else gdn_layers(kept, n))
    stats = None
    if args.init != "copy" or args.align or args.policy == "greedy":
        store = store_device_for(teacher.model, *splits.calib.shape, candidates, device)
        stats = collect_stats(teacher.model, splits.calib, store_layers=candidates, batch_size=args.eval_batch_size,
                              store_device=store)
    times["stats_s"] = time.perf_counter() - t

    t = time.perf_counter()
    mixers, p1 = calibrated_mixers(teacher.model, stats, candidates, args.init, args.calib, args.gdn, backend, args.seed,
                                   kept_groups)
    if args.policy == "greedy":
        scores = greedy_scores(teacher.model, mixers, splits.calib[:4], args.eval_batch_size)
        kept = kept_layers(args.policy, n, args.keep_every, scores, args.kv_budget)
    kept_groups = kept_groups or layer_groups(kept, n, kv)
    converted = [i for i in range(n) if len(kept_groups[i]) < kv]
    headwise = {i: kept_groups[i] for i in converted if kept_groups[i]}
    mixers = {i: mixers[i] for i in converted}
    if stats is not None:  # greedy stored every layer's rows; phase 2 reads only the converted ones
        for i in set(candidates) - set(converted):
            del stats.inputs[i], stats.head_outputs[i]
    times["phase1_s"] = time.perf_counter() - t

    t = time.perf_counter()
    p2 = None
    if args.align:
        for m in mixers.values():
            m.backend = train_backend
        targets = attention_targets(teacher.model, stats, converted, release=True, kept_groups=headwise)
        p2 = align_layers(mixers, {i: stats.inputs[i] for i in converted}, targets, args.phase2)
    times["phase2_s"] = time.perf_counter() - t

    hybrid = convert_teacher(teacher.model, converted, args.gdn, teacher_name=args.teacher, mixers=mixers,
                             kept_groups=headwise)
    hybrid.set_backend(backend)
    t = time.perf_counter()
    hybrid_eval = perplexity(hybrid, splits.heldout, args.eval_batch_size, desc="hybrid ppl")
    hybrid_retrieval = answer_scores(hybrid, probes) if probes else None
    times["hybrid_eval_s"] = time.perf_counter() - t

    report = {
        "teacher": args.teacher,
        "init": args.init,
        "align": args.align,
        "policy": args.policy,
        "layer_types": list(hybrid.config.layer_types),
        "kept_layers": kept,
        "gdn_layers": converted,
        "headwise_kept_groups": {str(i): g for i, g in headwise.items()},
        "kv_fraction": sum(len(g) for g in kept_groups.values()) / (n * kv),
        "policy_scores": scores,
        "teacher_ppl": teacher_eval["ppl"],
        "hybrid_ppl": hybrid_eval["ppl"],
        "retrieval": probes and {"teacher": teacher_retrieval, "hybrid": hybrid_retrieval, "probes": len(probes),
                                 "length": probe_len},
        "eval_tokens": hybrid_eval["tokens"],
        "calib_tokens": int(splits.calib.numel()),
        "phase1": p1,
        "phase2": p2,
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
    rows = [("teacher ppl", f"{teacher_eval['ppl']:.3f}"), (f"hybrid ppl ({init})", f"{hybrid_eval['ppl']:.3f}"),
            ("KV cache kept", f"{report['kv_fraction']:.1%} of the teacher's" + (f" (head-wise layers {sorted(headwise)})"
                                                                                 if headwise else ""))]
    if probes:
        rows += [(f"retrieval answer log-prob teacher / hybrid ({len(probes)} probes, {probe_len} tokens)",
                  f"{teacher_retrieval['logprob']:.2f} / {hybrid_retrieval['logprob']:.2f} nats"),
                 ("retrieval answer exact, teacher-forced: teacher / hybrid",
                  f"{teacher_retrieval['acc']:.2f} / {hybrid_retrieval['acc']:.2f}")]
    if p2 is not None:
        rows.append(("align rel-MSE before -> after", f"{p2['mean_rel_mse_before']:.3f} -> {p2['mean_rel_mse_after']:.3f}"))
    print_table(rows + [
        ("eval / calib tokens", f"{hybrid_eval['tokens']} / {report['calib_tokens']} ({profile} profile)"),
        ("params teacher / hybrid", f"{report['teacher_params'] / 1e6:.1f}M / {report['hybrid_params'] / 1e6:.1f}M"),
        ("backend / device / dtype", f"{backend} / {device} / {report['dtype']}"),
        ("stage seconds", ", ".join(f"{k[:-2]} {v:.0f}" for k, v in times.items())),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("output", str(Path(args.out) / REPORT) if save else "(not saved)"),
    ])
    return (report, hybrid) if return_model else report


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
