"""The `damage` experiment: what converting each layer (or each given set of layers) costs, zero-shot.

One teacher pass stores every layer's inputs and statistics; each layer gets its phase-1 (+ phase-2) mixer once
(teacher forcing makes layers independent, as in `ablate`). A set's hybrid is the teacher with those mixers swapped
in. For each set it measures retrieval on calibration probes long enough to pass every sliding window (the answer's
log-probability and whether every answer token is the argmax, per task), held-out NLL and KL to the teacher, and the
cache bytes the set leaves at --context. The per-layer table says which layers a teacher retrieves through, and what
each one's conversion costs against what it saves. Rows of --windows keep the teacher's attention but let the named
layers see only their last W positions: how far back a layer's retrieval reaches, which tells a layer that retrieves
over the whole context (no window, and no short memory, can stand in for it) from one whose reach is local.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from taylor_calibrate.checks import writes_out
from taylor_calibrate.config import DamageArgs, apply_profile
from taylor_calibrate.data import load_splits
from taylor_calibrate.evaluate import kl_sum, nll_sum
from taylor_calibrate.experiments.ablate import TeacherPass, parse_init
from taylor_calibrate.memory import attention_bytes, byte_budget
from taylor_calibrate.model.hybrid import swapped_into
from taylor_calibrate.model.hybrid_config import cached_layer_types
from taylor_calibrate.ops import resolve_backend, training_backend
from taylor_calibrate.policy import parse_layer_list
from taylor_calibrate.results import record
from taylor_calibrate.retrieval import answer_scores, calibration_probes, fitting_probes, selection_lengths
from taylor_calibrate.teacher import load_teacher, resolve_device, resolve_dtype


@torch.no_grad()
def heldout_damage(model, changed, rows: torch.Tensor, batch_size: int) -> dict:
    """Held-out NLL of the teacher and of the teacher as `changed()` (a context manager: mixers swapped in, windows
    imposed) leaves it, and KL(teacher || changed) with top-1 agreement, per predicted token."""
    device = next(model.parameters()).device
    nll_t = nll_h = kl = agree = 0.0
    count = 0
    for i in range(0, rows.shape[0], batch_size):
        ids = rows[i:i + batch_size].to(device)
        p = model(input_ids=ids, use_cache=False).logits
        with changed():
            q = model(input_ids=ids, use_cache=False).logits
        nll_t += nll_sum(p, ids)
        nll_h += nll_sum(q, ids)
        k, a = kl_sum(p[:, :-1], q[:, :-1])
        kl, agree, count = kl + k, agree + a, count + ids[:, 1:].numel()
    return {"nll_teacher": nll_t / count, "nll": nll_h / count, "kl": kl / count, "top1": agree / count}


def parse_window(spec: str, n: int) -> tuple[list[int], int]:
    """"LAYERS:W" (e.g. "5:1024", "5,11:512") -> (layers, W)."""
    layers, sep, w = spec.rpartition(":")
    if not sep or not w.isdigit() or int(w) < 1:
        raise ValueError(f"--windows entry {spec!r} is not LAYERS:W; e.g. \"5:1024\" lets layer 5 see only its last "
                         "1024 positions")
    return parse_layer_list(layers, n), int(w)


@contextlib.contextmanager
def windowed(model, layers: list[int], window: int):
    """The teacher with the attention of `layers` restricted to each query's last `window` positions (on top of the
    mask it already has); for cache-free forwards of unpadded rows."""
    def restrict(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        mask = kwargs.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise TypeError(f"windowed rows need a tensor attention mask, not {type(mask).__name__}; load the teacher "
                            "with attn_implementation sdpa or eager")
        T = hidden.shape[1]
        i = torch.arange(T, device=hidden.device)
        see = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
        if mask is None:
            mask = see[None, None]
        elif mask.dtype == torch.bool:
            mask = mask & see[..., -mask.shape[-1]:]
        else:
            mask = mask.masked_fill(~see[..., -mask.shape[-1]:], torch.finfo(mask.dtype).min)
        return args, {**kwargs, "attention_mask": mask}

    handles = [model.model.layers[i].self_attn.register_forward_pre_hook(restrict, with_kwargs=True) for i in layers]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def set_bytes(budget, converted: list[int]) -> float:
    """Cache bytes at the budget's context of the hybrid converting `converted`, as a fraction of the teacher's."""
    costs = budget.layer_costs()
    return sum(costs[i][1] if i in converted else costs[i][0] for i in costs) / budget.teacher


def window_bytes(budget, cfg, layers: list[int], window: int, dtype) -> float:
    """Cache bytes at the budget's context of the teacher with `layers` caching at most `window` positions, as a
    fraction of the teacher's."""
    per_position = attention_bytes(cfg, "full_attention", cfg.num_key_value_heads, 1, dtype)
    kept = {i: a for i, (a, _) in budget.layer_costs().items()}
    return sum(min(a, window * per_position) if i in layers else a for i, a in kept.items()) / budget.teacher


def markdown_table(result: dict) -> str:
    tasks = list(result["teacher_probes"]["tasks"])
    head = ("| converted (L) or windowed (L@W) | type | KV bytes | KL | dNLL | "
            + " | ".join(f"{t} dlogp / acc" for t in tasks) + " |")
    lines = [f"Teacher `{result['teacher']}`: calibration probes at {result['probe_lengths']} tokens "
             f"(teacher acc {result['teacher_probes']['acc']:.2f}), cache bytes at {result['context']} tokens.", "",
             head, "|---" * (5 + len(tasks)) + "|"]
    for r in result["rows"]:
        cells = " | ".join(f"{r['probes']['tasks'][t]['dlogprob']:+.2f} / {r['probes']['tasks'][t]['acc']:.2f}"
                           for t in tasks)
        lines.append(f"| {r['name']} | {r['types']} | {r['kv_fraction']:.1%} | {r['kl']:.3f} | {r['dnll']:+.3f} | "
                     f"{cells} |")
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


@writes_out("damage")
def run_damage(args: DamageArgs) -> dict:
    """Zero-shot cost of converting each layer (or each of --sets): retrieval on window-passing calibration probes,
    held-out NLL and KL to the teacher, cache bytes kept; JSON + markdown table."""
    t0 = time.perf_counter()
    method, aligned = parse_init(args.init)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backend)
    profile = apply_profile(args, device.type)
    teacher = load_teacher(args.teacher, device, dtype)
    model, cfg = teacher.model, teacher.model.config
    n = cfg.num_hidden_layers
    windows = [parse_window(w, n) for w in args.windows]
    sets = [parse_layer_list(s, n) for s in args.sets] or ([] if windows else [[i] for i in range(n)])
    if [] in sets:  # a row that converts nothing would read as a free conversion
        raise ValueError(f"--sets {args.sets} holds a set naming no layer ({args.sets[sets.index([])]!r}); give each "
                         "set one or more layers, e.g. '[\"5\", \"0-3\"]'")
    converted = sorted({i for s in sets for i in s})
    d = args.data
    splits = load_splits(d, teacher.tokenizer, d.seq_len, d.calib_seqs, d.eval_seqs)
    words = tuple(teacher.tokenizer.decode(splits.calib[:8].flatten()).split())
    lengths = selection_lengths(fitting_probes(teacher.tokenizer, cfg, d.seq_len, 1)[0], cfg)
    probes = [p for L in lengths for p in calibration_probes(teacher.tokenizer, words, length=L,
                                                             samples=args.probe_samples)]
    base = answer_scores(model, probes)

    mixers = {}
    if converted:
        tp = TeacherPass.run(model, splits.calib, converted, device, args.eval_batch_size,
                             store_far=aligned and args.phase2.far_weight > 0)
        mixers, _ = tp.mixers(converted, method, args.calib, args.gdn, backend, args.seed)
        if aligned:
            for m in mixers.values():
                m.backend = training_backend(backend, args.backend, True)
            tp.align(mixers, args.phase2)
            for m in mixers.values():
                m.backend = backend
    budget = byte_budget(cfg, args.gdn, 0.5, args.context, dtype)
    types = cached_layer_types(cfg)
    changes = [(",".join(map(str, s)), s, None, lambda s=s: swapped_into(model, {i: mixers[i] for i in s}),
                set_bytes(budget, s)) for s in sets]
    changes += [(f"{','.join(map(str, s))}@{w}", s, w, lambda s=s, w=w: windowed(model, s, w),
                 window_bytes(budget, cfg, s, w, dtype)) for s, w in windows]
    rows = []
    for name, layers, window, changed, kv_fraction in changes:
        with changed():
            scores = answer_scores(model, probes)
        held = heldout_damage(model, changed, splits.heldout, args.eval_batch_size)
        tasks = {t: {"dlogprob": v["logprob"] - base["tasks"][t]["logprob"], "acc": v["acc"]}
                 for t, v in scores["tasks"].items()}
        row = {"name": name, "converted": [] if window else layers, **({"windowed": layers, "window": window}
                                                                          if window else {}),
               "types": ",".join(sorted({types[i].replace("_attention", "") for i in layers})),
               "kv_fraction": kv_fraction, "kl": held["kl"], "top1": held["top1"],
               "dnll": held["nll"] - held["nll_teacher"],
               "probes": {"dlogprob": scores["logprob"] - base["logprob"], "acc": scores["acc"], "tasks": tasks}}
        rows.append(row)
        print(f"  {row['name']:>12} {row['types']:>8}  KL {row['kl']:.3f}  dNLL {row['dnll']:+.3f}  "
              f"probe dlogp {row['probes']['dlogprob']:+.2f} acc {row['probes']['acc']:.2f}")
    result = {"teacher": args.teacher, "init": args.init, "probe_lengths": lengths, "context": budget.context,
              "layer_types": types, "teacher_probes": base, "rows": rows, "profile": profile, "backend": backend,
              "device": str(device), "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    result = record(out / "damage.json", result, args)
    (out / "damage.md").write_text(markdown_table(result))
    print(markdown_table(result))
    return result
