"""The `convert` stage: teacher -> statistics -> policy -> phase 1 -> phase 2 -> hybrid -> held-out perplexity ->
export.

The stage function takes one argument dataclass (config.py), prints a table, writes `report.json` in its output
directory and returns the report dict. The README documents the report schema; keep keys stable.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from taylor_calibrate.align import align_attention, align_layers, realign_kept, roped
from taylor_calibrate.calibrate import calibrated_mixers
from taylor_calibrate.checks import check_context, check_out
from taylor_calibrate.config import ConvertArgs, apply_profile
from taylor_calibrate.data import load_splits
from taylor_calibrate.evaluate import check_finite_eval, perplexity, print_table
from taylor_calibrate.export import REPORT, check_finite, staged_dir
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.ops import resolve_backend, training_backend
from taylor_calibrate.results import record
from taylor_calibrate.policy import (ON_HYBRIDS, RETRIEVAL, SCORED, bypass_scores, combined_scores, gdn_layers,
                                     greedy_scores, group_scores, kept_groups_of, kept_layers, kl_scores, layer_groups)
from taylor_calibrate.qwen3_5 import check_qwen3_form, qwen3_form, start_qk_norm, target_gdn
from taylor_calibrate.retrieval import answer_scores, calibration_probes, eval_probes, probe_length
from taylor_calibrate.stats import (attention_targets, collect_stats, far_weights, retrieval_heads,
                                    store_device_for)
from taylor_calibrate.teacher import (GGUF_TOKENIZER_KEY, Teacher, gguf_tokenizer_metadata, load_teacher,
                                      resolve_device, resolve_dtype, teacher_gguf_path)

log = logging.getLogger("taylor_calibrate")


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def retrieval_probes(args, teacher: Teacher, fallback: bool = False):
    """(length, evaluation probes) for the retrieval report; with a context too short for them, the policies that
    select by retrieval fail (`fallback`, for --policy auto: args.policy becomes "uniform", logged), the others report
    no retrieval (logged)."""
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
        if args.policy in RETRIEVAL and fallback:
            log.warning("policy auto: the retrieval probes do not fit this teacher (%s); keeping layers uniformly", e)
            args.policy = "uniform"
        if args.policy in RETRIEVAL:
            raise ValueError(f"policy {args.policy!r} scores heads on retrieval probes, which do not fit: {e}") from e
        log.warning("no retrieval report: %s", e)
        return None, []


def resolve_policy(args) -> bool:
    """--policy auto -> the policy that keeps the teacher's retrieval heads: "heads", or "retrieval" (whole layers)
    for --target qwen3_5; resolved once, logged, written into args.policy. Returns whether it was auto
    (`retrieval_probes` then falls back to "uniform" when the probes cannot be built for this teacher)."""
    if args.policy != "auto":
        return False
    args.policy = "retrieval" if args.target == "qwen3_5" else "heads"
    log.info("policy auto -> %s (target %s)", args.policy, args.target)
    return True


def run_convert(args: ConvertArgs) -> dict:
    """Convert a teacher into a hybrid (phase 1 + phase 2 by default), evaluate both on held-out text, save it."""
    t0 = time.perf_counter()
    check_out(args.out, "convert", overwrite=args.overwrite, inputs={"--teacher": args.teacher})
    device = resolve_device(args.device)
    t = time.perf_counter()
    # fail before the (long) load; on a GPU this runs fla's backward once, compiling its kernels
    training_backend(resolve_backend(args.backend), args.backend, args.align)
    check_s = time.perf_counter() - t
    teacher = load_teacher(args.teacher, device, resolve_dtype(args.dtype, device))
    return convert_loaded(args, teacher, t0, times={"backend_check_s": check_s})


def convert_loaded(args: ConvertArgs, teacher: Teacher, t0: float | None = None, save: bool = True,
                   return_model: bool = False, times: dict | None = None):
    """The convert stage from a loaded teacher on (an in-memory one works too: benchmarks/perf_scale.py times
    random-weight teachers this way). `t0`: when the command started (load_teacher_s = time until now, less the
    stages the caller already timed in `times`); `save=False` skips writing the model and report.json;
    `return_model` returns (report, hybrid) instead of the report."""
    t0 = time.perf_counter() if t0 is None else t0
    times = dict(times or {})
    device = resolve_device(args.device)
    on = next(teacher.model.parameters()).device
    if on.type != device.type:
        raise ValueError(f"the teacher is on {on} but device={args.device!r} resolves to {device}; move it first")
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backend)
    profile = apply_profile(args, device.type)
    check_context(args.data.seq_len, teacher.model.config, args.data.beyond_context, "teacher")
    t = time.perf_counter()
    train_backend = training_backend(backend, args.backend, args.align)  # cached: run_convert timed the first call
    times.setdefault("backend_check_s", time.perf_counter() - t)
    adapt = False  # --target qwen3_5 from a teacher without q/k norm: kept attention layers change form
    if args.target == "qwen3_5":
        check_qwen3_form(teacher.model.config)
        target_gdn(args.gdn, teacher.model.config)
        adapt = teacher.model.config.model_type != "qwen3"

    n = teacher.model.config.num_hidden_layers
    kv = teacher.model.config.num_key_value_heads
    auto = resolve_policy(args)
    if args.policy not in SCORED + RETRIEVAL:  # fails early on a bad layer list
        kept_layers(args.policy, n, args.keep_every, kv_budget=args.kv_budget)
    times["load_teacher_s"] = time.perf_counter() - t0 - sum(times.values())

    t = time.perf_counter()
    d = args.data
    splits = load_splits(d, teacher.tokenizer, d.seq_len, d.calib_seqs, d.eval_seqs)
    times["data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    teacher_eval = perplexity(teacher.model, splits.heldout, args.eval_batch_size, desc="teacher ppl")
    check_finite_eval({"the teacher's": teacher_eval["ppl"]}, f"check the teacher {args.teacher}")
    probe_len, probes = retrieval_probes(args, teacher, fallback=auto)
    teacher_retrieval = answer_scores(teacher.model, probes) if probes else None
    times["teacher_eval_s"] = time.perf_counter() - t

    t = time.perf_counter()
    scores, kept_groups, retrieval_scores = None, None, None
    if args.policy not in SCORED + RETRIEVAL:  # after the probes: auto may have fallen back to uniform
        kept = kept_layers(args.policy, n, args.keep_every, kv_budget=args.kv_budget)
    elif args.policy == "bypass":
        scores = bypass_scores(teacher.model, splits.calib[:4], args.eval_batch_size)
        kept = kept_layers(args.policy, n, args.keep_every, scores, args.kv_budget)
    elif args.policy in RETRIEVAL:  # calibration needles in a calibration haystack: never the evaluation prompts
        words = tuple(teacher.tokenizer.decode(splits.calib[:8].flatten()).split())
        long = probe_length(4 * probe_len, teacher.model.config)  # retrieval heads far back too, not only near
        heads = retrieval_heads(teacher.model, [p for length in dict.fromkeys([probe_len, long])
                                                for p in calibration_probes(teacher.tokenizer, words, length=length,
                                                                            samples=args.probe_samples)])
        groups = group_scores(heads, kv)
        scores = groups.tolist()
        if args.policy == "heads":
            kept_groups = kept_groups_of(groups, args.keep_every, args.kv_budget)
            kept = [i for i, g in kept_groups.items() if len(g) == kv]
        elif args.policy == "retrieval":
            kept = kept_layers(args.policy, n, args.keep_every, groups.sum(1).tolist(), args.kv_budget)
        else:  # combined: chosen with the kl scores, after phase 1
            retrieval_scores = groups.sum(1).tolist()
    hybrids = args.policy in ON_HYBRIDS  # scored on hybrids of phase-1 mixers in every layer
    candidates = list(range(n)) if hybrids else (
        [i for i, g in kept_groups.items() if len(g) < kv] if kept_groups else gdn_layers(kept, n))
    stats = None
    stored = sorted(set(candidates) | set(kept if adapt and not hybrids else []))
    if args.init != "copy" or args.align or hybrids or adapt:
        store = store_device_for(teacher.model, *splits.calib.shape, stored, device)
        stats = collect_stats(teacher.model, splits.calib, store_layers=stored, batch_size=args.eval_batch_size,
                              store_device=store, store_far=args.align and args.phase2.far_weight > 0)
    times["stats_s"] = time.perf_counter() - t

    t = time.perf_counter()
    mixers, p1 = calibrated_mixers(teacher.model, stats, candidates, args.init, args.calib, args.gdn, backend, args.seed,
                                   kept_groups)
    if hybrids:
        score = greedy_scores if args.policy == "greedy" else kl_scores
        scores = layer_scores = score(teacher.model, mixers, splits.calib[:4], args.eval_batch_size)
        if args.policy == "combined":
            layer_scores = combined_scores(scores, retrieval_scores, args.policy_weight)
            scores = {"kl": scores, "retrieval": retrieval_scores, "weight": args.policy_weight,
                      "combined": layer_scores}
        kept = kept_layers(args.policy, n, args.keep_every, layer_scores, args.kv_budget)
    kept_groups = kept_groups or layer_groups(kept, n, kv)
    converted = [i for i in range(n) if len(kept_groups[i]) < kv]
    headwise = {i: kept_groups[i] for i in converted if kept_groups[i]}
    mixers = {i: mixers[i] for i in converted}
    if stats is not None:  # greedy / kl stored every layer's rows; phase 2 reads only the converted ones
        for i in set(candidates) - set(converted) - set(kept if adapt else []):
            del stats.inputs[i], stats.head_outputs[i]
            stats.far_mass.pop(i, None)
    times["phase1_s"] = time.perf_counter() - t

    t = time.perf_counter()
    p2 = None
    if args.align:
        for m in mixers.values():
            m.backend = train_backend
        targets = attention_targets(teacher.model, stats, converted, release=True, kept_groups=headwise)
        weights = far_weights(teacher.model, stats, converted, args.phase2.far_weight, headwise) \
            if args.phase2.far_weight else None
        p2 = align_layers(mixers, {i: stats.inputs[i] for i in converted}, targets, args.phase2, weights=weights)
    times["phase2_s"] = time.perf_counter() - t

    t = time.perf_counter()
    form, p2_attention, qk_pairs = teacher.model, None, None
    if args.target == "qwen3_5":
        form = qwen3_form(teacher.model)
    if adapt:  # q/k RMSNorm added to the kept attention: closed-form start, then phase 2's alignment
        attns = {i: roped(form, i, form.model.layers[i].self_attn) for i in kept}
        qk_pairs = {i: start_qk_norm(m.attn, m.rotary, stats.inputs[i][:args.calib.fit_rows].to(device))
                    for i, m in attns.items()}
        if args.align:
            targets = attention_targets(teacher.model, stats, kept, release=True)
            p2_attention = align_attention(attns, {i: stats.inputs[i] for i in kept}, targets, args.phase2)
    times["target_s"] = time.perf_counter() - t

    hybrid = convert_teacher(form, converted, args.gdn, teacher_name=args.teacher, mixers=mixers,
                             kept_groups=headwise)
    hybrid.set_backend(backend)
    p2_kept = None
    if args.align and args.phase2.kept_attention:
        t = time.perf_counter()
        p2_kept = realign_kept(hybrid, teacher.model, splits.calib, args.phase2, args.eval_batch_size)
        times["realign_s"] = time.perf_counter() - t
    diverged = {i: r["diverged_at"] for i, r in (p2 or {}).get("layers", {}).items()
                if r.get("diverged_at") is not None}
    fix = "nothing was saved; lower the phase-2 learning rates (--phase2.lr, --phase2.lr_qkv) or check the options"
    if diverged:
        fix += f" (phase 2 diverged in layer(s) {sorted(diverged)})"
    check_finite(hybrid, "the converted model", fix)
    t = time.perf_counter()
    hybrid_eval = perplexity(hybrid, splits.heldout, args.eval_batch_size, desc="hybrid ppl")
    check_finite_eval({"the converted model's": hybrid_eval["ppl"]}, fix)
    hybrid_retrieval = answer_scores(hybrid, probes) if probes else None
    times["hybrid_eval_s"] = time.perf_counter() - t

    report = {
        "teacher": args.teacher,
        "init": args.init,
        "align": args.align,
        "policy": args.policy,
        "policy_auto": auto,
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
        "target": args.target,
        "phase2_attention": p2_attention,
        "phase2_kept_attention": p2_kept,
        "qk_norm_spare_pairs": qk_pairs,
        "teacher_params": _count(teacher.model),
        "hybrid_params": _count(hybrid),
        "profile": profile,
        "backend": backend,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "stage_s": times,
    }
    if save:  # model, tokenizer and report appear together, or not at all
        with staged_dir(args.out) as tmp:
            t = time.perf_counter()
            hybrid.save_pretrained(tmp, safe_serialization=True)
            gguf_path = teacher_gguf_path(args.teacher)
            if gguf_path is not None:  # what transformers' GGUF tokenizer drops; a GGUF export writes it back
                teacher.tokenizer.init_kwargs[GGUF_TOKENIZER_KEY] = gguf_tokenizer_metadata(gguf_path)
            teacher.tokenizer.save_pretrained(tmp)
            times["save_s"] = time.perf_counter() - t
            report["wall_s"] = time.perf_counter() - t0
            report = record(tmp / REPORT, report, args)
    else:
        report["wall_s"] = time.perf_counter() - t0

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
    if p2_attention is not None:
        a = p2_attention
        rows.append(("kept attention + q/k norm, rel-MSE", f"{a['mean_rel_mse_before']:.3f} -> {a['mean_rel_mse_after']:.3f}"))
    if p2_kept is not None:
        a = p2_kept
        rows.append(("kept attention on hybrid inputs, rel-MSE",
                     f"{a['mean_rel_mse_before']:.3f} -> {a['mean_rel_mse_after']:.3f}"))
    print_table(rows + [
        ("eval / calib tokens", f"{hybrid_eval['tokens']} / {report['calib_tokens']} ({profile} profile)"),
        ("params teacher / hybrid", f"{report['teacher_params'] / 1e6:.1f}M / {report['hybrid_params'] / 1e6:.1f}M"),
        ("backend / device / dtype", f"{backend} / {device} / {report['dtype']}"),
        ("stage seconds", ", ".join(f"{k[:-2]} {v:.0f}" for k, v in times.items())),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("output", str(Path(args.out) / REPORT) if save else "(not saved)"),
    ])
    for i, step in sorted(diverged.items()):
        print(f"  note: phase 2 diverged in layer {i} at step {step}; the layer was put back to its best state")
    if save:  # conversion alone keeps near needles; the end-to-end phase brings back the far ones (README, Results)
        seq = min(4096, getattr(teacher.model.config, "max_position_embeddings", None) or 4096)  # as check_context
        print(f"  next, on a GPU (the end-to-end phase; it brings back long-range retrieval): taylor-calibrate distill "
              f"--student {args.out} --data.seq_len {seq} --train.tokens 20000000 --data.source YOUR_TEXT")
    return (report, hybrid) if return_model else report
