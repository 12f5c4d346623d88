"""The `convert` stage: teacher -> what stays -> statistics -> phase 1 -> phase 2 -> target form -> evaluation -> save.

`run_convert` is the command: it resolves the runtime once, loads the teacher, calls `convert` and saves the hybrid
with `report.json` (its keys: docs/cli.md). `convert` is the same conversion for a teacher already in memory
(`recovery`, `tradeoff` and the benchmarks call it); each stage below is a function that takes what it needs and
returns what it made, and resolved options come back as a new argument object, never written into the caller's.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from taylor_calibrate.align import align_attention, align_layers, realign_kept, resolve_lr_scale, roped
from taylor_calibrate.calibrate import calibrated_mixers
from taylor_calibrate.checkpoint import REPORT, check_finite, staged_dir
from taylor_calibrate.checks import check_context, writes_out
from taylor_calibrate.config import ConvertArgs, apply_profile
from taylor_calibrate.data import TokenSplits, load_splits
from taylor_calibrate.evaluate import agreement, check_finite_eval, perplexity, print_table
from taylor_calibrate.export.qwen3_5 import check_qwen3_form, qwen3_form, start_qk_norm, target_gdn
from taylor_calibrate.memory import byte_budget, cache_report, cache_rows, default_context
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.model.loading import tokenizer_fingerprint
from taylor_calibrate.ops import resolve_backend, training_backend
from taylor_calibrate.policy import (ON_HYBRIDS, RETRIEVAL, SCORED, causal_scores, combined_scores, gdn_layers,
                                     group_scores, kept_groups_of, kept_layers, knockout_candidates, layer_groups,
                                     layer_scores)
from taylor_calibrate.results import WROTE, record
from taylor_calibrate.retrieval import answer_scores, calibration_probes, fitting_probes, selection_lengths
from taylor_calibrate.stats import (attention_targets, collect_stats, far_weights, knockout_drops, retrieval_heads,
                                   store_device_for)
from taylor_calibrate.teacher import (GGUF_TOKENIZER_KEY, Teacher, load_teacher, resolve_device, resolve_dtype,
                                      shared_gguf_readers, teacher_config_hash, teacher_gguf_tokenizer, teacher_hash,
                                      teacher_ref)

log = logging.getLogger("taylor_calibrate")


@dataclass
class Runtime:
    """Where and how a conversion runs, resolved once: device, dtype, the GDN kernels for inference and for
    alignment (`backend` "auto" -> "fla" or "torch", logged; a missing backend asked for by name fails here)."""

    device: torch.device
    dtype: torch.dtype
    backend: str
    train_backend: str


def resolve_runtime(args: ConvertArgs) -> Runtime:
    """On a GPU the alignment backend check runs fla's backward once (compiling its kernels): before the teacher
    loads, so that a missing or broken backend fails early."""
    device = resolve_device(args.device)
    backend = resolve_backend(args.backend)
    return Runtime(device, resolve_dtype(args.dtype, device), backend,
                   training_backend(backend, args.backend, args.align))


class Clock:
    """Wall seconds per named stage (report.json's `stage_s`), from the command's start."""

    def __init__(self):
        self.t0, self.times = time.perf_counter(), {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        t = time.perf_counter()
        yield
        self.times[f"{stage}_s"] = time.perf_counter() - t

    def wall(self) -> float:
        return time.perf_counter() - self.t0


@dataclass
class Choice:
    """What stays softmax attention: whole `kept` layers, and for head-wise layers the KV groups kept per layer."""

    policy: str
    kept: list[int] | None = None
    kept_groups: dict[int, list[int]] | None = None
    scores: object = None
    retrieval_scores: list[float] | None = None  # `combined`: the retrieval half, mixed in after phase 1
    knockouts: dict | None = None  # retrieval policies: the needle attention mass and the knockouts that ranked it

    def settled(self, n: int, kv: int) -> "Choice":
        """The choice with every layer's kept groups filled in (whole layers: all groups or none)."""
        return Choice(self.policy, self.kept, self.kept_groups or layer_groups(self.kept, n, kv), self.scores,
                      knockouts=self.knockouts)

    def converted(self, kv: int) -> list[int]:
        """Layers with GDN heads (the choice must be settled)."""
        return [i for i, g in self.kept_groups.items() if len(g) < kv]

    def headwise(self, kv: int) -> dict[int, list[int]]:
        """Converted layers that keep some of their KV groups: {layer: kept groups}."""
        return {i: g for i, g in self.kept_groups.items() if g and len(g) < kv}


@dataclass
class Conversion:
    """What `convert` made: the hybrid, its report, and the arguments as resolved."""

    hybrid: torch.nn.Module
    report: dict
    args: ConvertArgs


def resolve_args(args: ConvertArgs, config, device_type: str) -> tuple[ConvertArgs, bool]:
    """A copy of `args` with the profile's sizes filled in, `--policy auto` resolved (logged) and the target's GDN
    options set; fails early on a teacher the target cannot take. Returns (args, was auto)."""
    args = copy.deepcopy(args)
    apply_profile(args, device_type)
    check_context(args.data.seq_len, config, args.data.beyond_context, "teacher")
    if args.target == "qwen3_5":
        check_qwen3_form(config)
        target_gdn(args.gdn, config)
    auto = args.policy == "auto"
    if auto:  # the policy that keeps the teacher's retrieval heads: "heads", or whole layers for --target qwen3_5
        args.policy = "retrieval" if args.target == "qwen3_5" else "heads"
        log.info("policy auto -> %s (target %s)", args.policy, args.target)
    return args, auto


def retrieval_probes(args: ConvertArgs, teacher: Teacher, auto: bool) -> tuple[int | None, list, str]:
    """(length, evaluation probes, policy) for the retrieval report. With a context too short for the probes, the
    policies that select by retrieval fail, or under `--policy auto` fall back to "uniform" (logged); the others
    report no retrieval (logged)."""
    try:
        return *fitting_probes(teacher.tokenizer, teacher.model.config, args.data.seq_len, args.probe_samples), \
            args.policy
    except ValueError as e:
        if args.policy in RETRIEVAL and auto:
            log.warning("policy auto: the retrieval probes do not fit this teacher (%s); keeping layers uniformly", e)
            return None, [], "uniform"
        if args.policy in RETRIEVAL:
            ctx = getattr(teacher.model.config, "max_position_embeddings", None)
            raise ValueError(f"policy {args.policy!r} scores heads on retrieval probes, which do not fit this teacher "
                             f"(context {ctx}; {e}); pass a policy that needs no probes (--policy kl or uniform)"
                             ) from e
        log.warning("no retrieval report: %s", e)
        return None, [], args.policy


def evaluate_teacher(args: ConvertArgs, teacher: Teacher, splits: TokenSplits, auto: bool):
    """The teacher's held-out perplexity and teacher-forced retrieval: (eval, retrieval, probe length, probes, policy
    after a possible fallback)."""
    teacher_eval = perplexity(teacher.model, splits.heldout, args.eval_batch_size, desc="teacher ppl")
    check_finite_eval({"the teacher's": teacher_eval["ppl"]}, f"check the teacher {args.teacher}")
    probe_len, probes, policy = retrieval_probes(args, teacher, auto)
    return teacher_eval, answer_scores(teacher.model, probes) if probes else None, probe_len, probes, policy


def choose_from_teacher(args: ConvertArgs, teacher: Teacher, splits: TokenSplits, probe_len: int | None,
                        budget) -> Choice:
    """What stays, for the policies that decide from the teacher alone (all but greedy / kl / combined, which
    `choose_on_hybrids` decides after phase 1): fixed layers, bypass scores, or the heads the teacher retrieves with
    on calibration needles in a calibration haystack (never the evaluation prompts). `budget`: --kv_budget in bytes
    (memory.byte_budget), or None for one unit in --keep_every."""
    cfg = teacher.model.config
    n, kv, policy = cfg.num_hidden_layers, cfg.num_key_value_heads, args.policy
    if policy not in SCORED + RETRIEVAL:
        return Choice(policy, kept_layers(policy, n, args.keep_every, kv_budget=budget))
    if policy == "bypass":
        scores = layer_scores(policy, teacher.model, None, splits.calib[:4], args.eval_batch_size)
        return Choice(policy, kept_layers(policy, n, args.keep_every, scores, budget), scores=scores)
    if policy not in RETRIEVAL:
        return Choice(policy)
    words = tuple(teacher.tokenizer.decode(splits.calib[:8].flatten()).split())
    lengths = selection_lengths(probe_len, cfg)  # retrieval far back too, past every window
    probes = {length: calibration_probes(teacher.tokenizer, words, length=length, samples=args.probe_samples)
              for length in lengths}
    mass = group_scores(retrieval_heads(teacher.model, [p for ps in probes.values() for p in ps]), kv)
    if policy == "heads":
        def keeps(scores):
            return {(i, g) for i, gs in kept_groups_of(scores, args.keep_every, budget).items() for g in gs}
    else:
        def keeps(scores):
            return {(i, g) for i in kept_layers("retrieval", n, args.keep_every, scores.sum(1).tolist(), budget)
                    for g in range(kv)}
    groups, knockouts = knocked_out(teacher.model, mass, probes[lengths[-1]], keeps)
    if policy == "heads":
        kept_groups = kept_groups_of(groups, args.keep_every, budget)
        return Choice(policy, [i for i, g in kept_groups.items() if len(g) == kv], kept_groups, groups.tolist(),
                      knockouts=knockouts)
    if policy == "retrieval":
        return Choice(policy, kept_layers(policy, n, args.keep_every, groups.sum(1).tolist(), budget),
                      scores=groups.tolist(), knockouts=knockouts)
    return Choice(policy, scores=groups.tolist(), retrieval_scores=groups.sum(1).tolist(),  # combined
                  knockouts=knockouts)


def knocked_out(model, mass: torch.Tensor, probes: list, keeps, per_task: int = 4) -> tuple[torch.Tensor, dict]:
    """Retrieval scores that follow what the answer needs: the groups with the most needle attention (`mass`,
    (layers, KV groups)) are knocked out one at a time on the longest selection probes (`per_task` of each task),
    and `policy.causal_scores` ranks them by the answer log-probability lost. Only needed when the budget cannot keep
    every candidate (`keeps(scores)`: the units a policy keeps under these scores); otherwise any order among them
    keeps the same set, and the mass is the score. Returns (scores, the knockout record or None)."""
    units = knockout_candidates(mass)
    if set(units) <= keeps(mass):
        return mass, None
    per = model.config.num_attention_heads // mass.shape[1]
    tasks = dict.fromkeys(p.task for p in probes)
    chosen = [p for t in tasks for p in [q for q in probes if q.task == t][:per_task]]
    drops = knockout_drops(model, chosen, [(i, list(range(g * per, (g + 1) * per))) for i, g in units])
    record = {"mass": mass.tolist(), "units": [list(u) for u in units], "drops": drops, "probes": len(chosen)}
    return causal_scores(mass, dict(zip(units, drops))), record


def candidate_layers(choice: Choice, n: int, kv: int) -> list[int]:
    """Layers that get a phase-1 mixer: every layer for the policies that score hybrids, else the converted ones."""
    if choice.policy in ON_HYBRIDS:
        return list(range(n))
    if choice.kept_groups:
        return [i for i, g in choice.kept_groups.items() if len(g) < kv]
    return gdn_layers(choice.kept, n)


def teacher_statistics(args: ConvertArgs, teacher: Teacher, splits: TokenSplits, layers: list[int], device):
    """Attention statistics of every layer, and the inputs and head outputs of `layers` that phase 1 and 2 read."""
    store = store_device_for(teacher.model, *splits.calib.shape, layers, device)
    return collect_stats(teacher.model, splits.calib, store_layers=layers, batch_size=args.eval_batch_size,
                         store_device=store, store_far=args.align and args.phase2.far_weight > 0)


def choose_on_hybrids(args: ConvertArgs, teacher: Teacher, mixers: dict, splits: TokenSplits, choice: Choice,
                      budget) -> Choice:
    """greedy / kl / combined: the layers whose restoration to attention most helps a hybrid of phase-1 mixers."""
    n = teacher.model.config.num_hidden_layers
    scores = chosen = layer_scores(choice.policy, teacher.model, mixers, splits.calib[:4], args.eval_batch_size)
    if choice.policy == "combined":
        chosen = combined_scores(scores, choice.retrieval_scores, args.policy_weight)
        scores = {"kl": scores, "retrieval": choice.retrieval_scores, "weight": args.policy_weight,
                  "combined": chosen}
    return Choice(choice.policy, kept_layers(choice.policy, n, args.keep_every, chosen, budget), scores=scores)


def phase2(args: ConvertArgs, teacher: Teacher, stats, mixers: dict, headwise: dict, backend: str) -> dict | None:
    """Per-layer alignment of the mixers to the teacher's attention output, positions weighted by how far back the
    teacher reaches (--phase2.far_weight)."""
    if not args.align:
        return None
    layers = list(mixers)
    for m in mixers.values():
        m.backend = backend
    targets = attention_targets(teacher.model, stats, layers, release=True, kept_groups=headwise)
    weights = far_weights(teacher.model, stats, layers, args.phase2.far_weight, headwise) \
        if args.phase2.far_weight else None
    return align_layers(mixers, {i: stats.inputs[i] for i in layers}, targets, args.phase2, weights=weights)


def target_form(args: ConvertArgs, teacher: Teacher, stats, kept: list[int], device):
    """The teacher in the target's form: itself, or for --target qwen3_5 its Qwen3 form, whose kept attention of a
    teacher without q/k norm gets q/k RMSNorm (closed-form start, then aligned like phase 2). Returns (form, the
    kept attention's alignment report, the q/k-norm spare pairs)."""
    if args.target != "qwen3_5":
        return teacher.model, None, None
    form = qwen3_form(teacher.model)
    if teacher.model.config.model_type == "qwen3":
        return form, None, None
    attns = {i: roped(form, i, form.model.layers[i].self_attn) for i in kept}
    qk_pairs = {i: start_qk_norm(m.attn, m.rotary, stats.inputs[i][:args.calib.fit_rows].to(device))
                for i, m in attns.items()}
    report = None
    if args.align:
        targets = attention_targets(teacher.model, stats, kept, release=True)
        report = align_attention(attns, {i: stats.inputs[i] for i in kept}, targets, args.phase2)
    return form, report, qk_pairs


def convert(args: ConvertArgs, teacher: Teacher, rt: Runtime, clock: Clock | None = None) -> Conversion:
    """Convert a loaded teacher into a hybrid and evaluate both on held-out text (nothing is saved)."""
    clock = clock or Clock()
    cfg = teacher.model.config
    on = next(teacher.model.parameters()).device
    if on.type != rt.device.type:
        raise ValueError(f"the teacher is on {on} but device={args.device!r} resolves to {rt.device}; move it first")
    n, kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    args, auto = resolve_args(args, cfg, rt.device.type)
    if args.align:
        resolve_lr_scale(args.phase2, teacher.model)
    context = default_context(cfg, args.context)
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if max_pos and context > max_pos:
        log.warning("--context %d is beyond the teacher's max_position_embeddings %d: the cache is counted (and "
                    "--kv_budget spent) at a length the teacher was not trained for", context, max_pos)
    budget = byte_budget(cfg, args.gdn, args.kv_budget, context, rt.dtype)  # --kv_budget: bytes at --context
    if args.policy not in SCORED + RETRIEVAL:  # a bad layer list or an unreachable budget fails before any work
        kept_layers(args.policy, n, args.keep_every, kv_budget=budget)
    adapt = args.target == "qwen3_5" and cfg.model_type != "qwen3"  # kept attention changes form too

    with clock("data"):
        d = args.data
        splits = load_splits(d, teacher.tokenizer, d.seq_len, d.calib_seqs, d.eval_seqs)
    with clock("teacher_eval"):
        teacher_eval, teacher_retrieval, probe_len, probes, policy = evaluate_teacher(args, teacher, splits, auto)
        args.policy = policy
    with clock("stats"):
        choice = choose_from_teacher(args, teacher, splits, probe_len, budget)
        candidates = candidate_layers(choice, n, kv)
        hybrids = policy in ON_HYBRIDS
        stored = sorted(set(candidates) | set(choice.kept if adapt and not hybrids else []))
        needed = args.init != "copy" or args.align or hybrids or adapt
        stats = teacher_statistics(args, teacher, splits, stored, rt.device) if needed else None
    with clock("phase1"):
        mixers, p1 = calibrated_mixers(teacher.model, stats, candidates, args.init, args.calib, args.gdn, rt.backend,
                                       args.seed, choice.kept_groups)
        if hybrids:
            choice = choose_on_hybrids(args, teacher, mixers, splits, choice, budget)
        choice = choice.settled(n, kv)
        converted, headwise = choice.converted(kv), choice.headwise(kv)
        mixers = {i: mixers[i] for i in converted}
        if stats is not None:  # greedy / kl stored every layer's rows; phase 2 reads only the converted ones
            stats.release(set(candidates) - set(converted) - set(choice.kept if adapt else []))
    with clock("phase2"):
        p2 = phase2(args, teacher, stats, mixers, headwise, rt.train_backend)
    with clock("target"):
        form, p2_attention, qk_pairs = target_form(args, teacher, stats, choice.kept if adapt else [], rt.device)
    hybrid = convert_teacher(form, converted, args.gdn, teacher_name=teacher_ref(args.teacher), mixers=mixers,
                             kept_groups=headwise)
    hybrid.set_backend(rt.backend)
    p2_kept = None
    if args.align and args.phase2.kept_attention:
        with clock("realign"):
            p2_kept = realign_kept(hybrid, teacher.model, splits.calib, args.phase2, args.eval_batch_size)
    fix = diverged_fix(p2)
    check_finite(hybrid, "the converted model", fix)
    with clock("hybrid_eval"):
        hybrid_eval = perplexity(hybrid, splits.heldout, args.eval_batch_size, desc="hybrid ppl")
        check_finite_eval({"the converted model's": hybrid_eval["ppl"]}, fix)
        agree = agreement(hybrid, teacher.model, splits.heldout, args.eval_batch_size)  # a hybrid aligned on a
        # text can beat its teacher's perplexity there: KL says how far it is from the teacher
        hybrid_retrieval = answer_scores(hybrid, probes) if probes else None

    report = {
        "teacher": args.teacher, "init": args.init, "align": aligned(args), "policy": policy, "policy_auto": auto,
        "layer_types": list(hybrid.config.layer_types), "kept_layers": choice.kept, "gdn_layers": converted,
        "headwise_kept_groups": {str(i): g for i, g in headwise.items()},
        **cache_report(cfg, hybrid.config, context, rt.dtype),  # context, kv_bytes, kv_fraction (bytes)
        "policy_scores": choice.scores, "retrieval_knockouts": choice.knockouts,
        "teacher_ppl": teacher_eval["ppl"], "hybrid_ppl": hybrid_eval["ppl"], "agreement": agree,
        "retrieval": probes and {"teacher": teacher_retrieval, "hybrid": hybrid_retrieval, "probes": len(probes),
                                 "length": probe_len},
        "eval_tokens": hybrid_eval["tokens"], "calib_tokens": int(splits.calib.numel()),
        "phase1": p1, "phase2": p2, "target": args.target, "phase2_attention": p2_attention,
        "phase2_kept_attention": p2_kept, "qk_norm_spare_pairs": qk_pairs,
        "teacher_params": _count(teacher.model), "hybrid_params": _count(hybrid), "profile": args.profile,
        "backend": rt.backend, "device": str(rt.device), "dtype": str(rt.dtype).replace("torch.", ""),
        "stage_s": clock.times, "wall_s": clock.wall(),
    }
    return Conversion(hybrid, report, args)


def diverged_fix(p2: dict | None) -> str:
    """The fix to name when the hybrid or its perplexity is not finite."""
    fix = "nothing was saved; lower the phase-2 learning rates (--phase2.lr, --phase2.lr_qkv) or check the options"
    diverged = sorted(i for i, r in (p2 or {}).get("layers", {}).items() if r.get("diverged_at") is not None)
    return fix + (f" (phase 2 diverged in layer(s) {diverged})" if diverged else "")


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@writes_out("convert")
def run_convert(args: ConvertArgs) -> dict:
    """Convert a teacher into a hybrid (phase 1 + phase 2 by default), evaluate both on held-out text, save it."""
    clock = Clock()
    with clock("backend_check"):
        rt = resolve_runtime(args)
    with clock("load_teacher"), shared_gguf_readers():  # a GGUF teacher's file parsed once for all of it
        teacher = load_teacher(args.teacher, rt.device, rt.dtype)
        origin = teacher_hash(args.teacher)  # what `distill` checks its teacher against
        origin_config = teacher_config_hash(args.teacher)
        gguf_tokenizer = teacher_gguf_tokenizer(args.teacher)  # what transformers' GGUF tokenizer drops (export)
    conv = convert(args, teacher, rt, clock)
    report = conv.report
    with staged_dir(args.out) as tmp:  # model, tokenizer and report appear together, or not at all
        with clock("save"):
            if gguf_tokenizer is not None:
                teacher.tokenizer.init_kwargs[GGUF_TOKENIZER_KEY] = gguf_tokenizer
            teacher.tokenizer.save_pretrained(tmp)
            # the tokenizer as readers will load it, recorded in the model's config (a distilled copy keeps it)
            conv.hybrid.config.tokenizer_fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp))
            conv.hybrid.save_pretrained(tmp, safe_serialization=True)
        report["wall_s"] = clock.wall()
        report["teacher_hash"] = origin
        report["teacher_config_hash"] = origin_config
        report[WROTE] = sorted([p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()] + [REPORT])
        report = record(tmp / REPORT, report, conv.args)
    print_summary(report, conv.args, Path(args.out) / REPORT)
    seq = min(4096, getattr(teacher.model.config, "max_position_embeddings", None) or 4096)  # as check_context
    print("  next, on a GPU (the end-to-end phase; it brings back long-range retrieval): "
          + phase_command(report, args.out, seq))
    return report


def phase_command(report: dict, out: str, seq: int) -> str:
    """The end-to-end phase to run next. `--train.train mixers` trains only the converted layers' mixers; where fewer
    than half the layers hold GDN heads (a windowed teacher whose global layers are few, e.g. Gemma 3), that leaves
    the kept layers unable to take over what a converted layer did for retrieval, so every parameter trains, at the
    lower rate that wants (measured on Gemma 3: docs/results.md, run 18)."""
    cmd = (f"taylor-calibrate distill --student {shlex.quote(str(out))} --data.seq_len {seq} "
           "--train.tokens 20000000 "
           "--data.source YOUR_TEXT")
    if 2 * len(report["gdn_layers"]) < len(report["layer_types"]):
        cmd += " --train.train all --train.lr 1e-4 --train.repeat_spans 0.5 --train.recall_rows 0.25"
    return cmd


def aligned(args: ConvertArgs) -> bool:
    """Whether the conversion aligned its layers: --align, with phase 2 given steps to take."""
    return bool(args.align and args.phase2.steps)


def print_summary(report: dict, args: ConvertArgs, out: Path | None) -> None:
    """The conversion's table: perplexity, KV kept, retrieval, alignment error, sizes, stage times."""
    n, kept, headwise = len(report["layer_types"]), report["kept_layers"], report["headwise_kept_groups"]
    print(f"\nconverted {args.teacher}: {len(report['gdn_layers'])} of {n} layers -> GDN ({args.policy}), "
          f"kept attention {kept}")
    init = f"{args.init}{' + align' if aligned(args) else ''}"
    rows = [("teacher ppl", f"{report['teacher_ppl']:.3f}"), (f"hybrid ppl ({init})", f"{report['hybrid_ppl']:.3f}"),
            ("KL to the teacher / top-1 agreement", f"{report['agreement']['kl']:.4f} nats / "
                                                    f"{report['agreement']['top1']:.3f}"),
            *cache_rows(report)]  # cache bytes at 4K / 32K / 128K and --context
    if headwise:
        rows.append(("head-wise layers", str(sorted(int(i) for i in headwise))))
    if report["retrieval"]:
        r = report["retrieval"]
        rows += [(f"retrieval answer log-prob teacher / hybrid ({r['probes']} probes, {r['length']} tokens)",
                  f"{r['teacher']['logprob']:.2f} / {r['hybrid']['logprob']:.2f} nats"),
                 ("retrieval answer exact, teacher-forced (not generated: eval --niah): teacher / hybrid",
                  f"{r['teacher']['acc']:.2f} / {r['hybrid']['acc']:.2f}")]
    for key, label in (("phase2", "align rel-MSE before -> after"),
                       ("phase2_attention", "kept attention + q/k norm, rel-MSE"),
                       ("phase2_kept_attention", "kept attention on hybrid inputs, rel-MSE")):
        if report[key] is not None:
            a = report[key]
            rows.append((label, f"{a['mean_rel_mse_before']:.3f} -> {a['mean_rel_mse_after']:.3f}"))
    times = report["stage_s"]
    print_table(rows + [
        ("eval / calib tokens", f"{report['eval_tokens']} / {report['calib_tokens']} ({report['profile']} profile)"),
        ("params teacher / hybrid", f"{report['teacher_params'] / 1e6:.1f}M / {report['hybrid_params'] / 1e6:.1f}M"),
        ("backend / device / dtype", f"{report['backend']} / {report['device']} / {report['dtype']}"),
        ("stage seconds", ", ".join(f"{k[:-2]} {v:.0f}" for k, v in times.items())),
        ("wall time", f"{report['wall_s']:.1f} s"),
        ("output", str(out) if out else "(not saved)"),
    ])
    for i, r in sorted((report["phase2"] or {}).get("layers", {}).items()):
        if r.get("diverged_at") is not None:
            print(f"  note: phase 2 diverged in layer {i} at step {r['diverged_at']}; the layer was put back to its "
                  "best state")
