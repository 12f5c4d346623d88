"""The `ablate` stage: zero-shot held-out perplexity for every init x layer policy (docs/method.md, "Phase 1:
calibration"; docs/decisions.md).

One teacher pass gives statistics, inputs and targets for *every* layer; each init then builds (and, for the
"+align" rows, aligns) a mixer for every layer once. Teacher forcing makes layers independent, so the mixers of any
policy's converted layers are those same mixers: a policy's hybrid is the teacher with them swapped in. Policies are
chosen once (bypass from the teacher, greedy and kl from the taylor phase-1 mixers) and shared by all inits.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from taylor_calibrate.checks import writes_out
from taylor_calibrate.align import align_layers, resolve_lr_scale
from taylor_calibrate.calibrate import calibrated_mixers
from taylor_calibrate.config import INITS, AblateArgs, AlignArgs, apply_profile
from taylor_calibrate.data import load_splits
from taylor_calibrate.evaluate import perplexity
from taylor_calibrate.results import record
from taylor_calibrate.model.hybrid import swapped_into
from taylor_calibrate.ops import resolve_backend, training_backend
from taylor_calibrate.policy import RETRIEVAL, gdn_layers, kept_layers, layer_scores
from taylor_calibrate.stats import TeacherStats, attention_targets, collect_stats, far_weights
from taylor_calibrate.teacher import load_teacher, resolve_device, resolve_dtype


def parse_init(spec: str) -> tuple[str, bool]:
    """"taylor+align" -> ("taylor", True); "align" (phase-2-only) -> ("copy", True)."""
    if spec == "align":
        return "copy", True
    method, plus, rest = spec.partition("+")
    if method not in INITS or (plus and rest != "align"):
        raise ValueError(f"bad init spec {spec!r}: use <{'|'.join(INITS)}>[+align] or align")
    return method, rest == "align"


@dataclass
class TeacherPass:
    """One teacher pass over calibration rows that every variant of a zero-shot comparison reuses (teacher forcing
    makes the layers independent): statistics, the stored inputs of `layers` and their phase-2 targets. A variant is
    then phase 1 (`mixers`), optionally phase 2 (`align`), and the teacher with its mixers swapped in (`perplexity`)."""

    model: torch.nn.Module
    stats: TeacherStats
    targets: dict[int, Tensor]

    @classmethod
    def run(cls, model, rows: Tensor, layers, device, batch_size: int = 4, store_far: bool = False) -> "TeacherPass":
        stats = collect_stats(model, rows, store_layers=layers, batch_size=batch_size, store_device=device,
                              store_far=store_far)
        return cls(model, stats, attention_targets(model, stats, layers))

    def mixers(self, layers, init: str, calib, gdn, backend: str, seed: int = 0):
        """Phase 1 with method `init` on `layers`: (mixers, report)."""
        return calibrated_mixers(self.model, self.stats, layers, init, calib, gdn, backend, seed)

    def align(self, mixers: dict, args: AlignArgs, inputs: dict | None = None) -> dict:
        """Phase 2 on `mixers` (in place), from the stored teacher inputs (or `inputs`) to the teacher's targets; with
        `args.far_weight`, positions weighted as convert weighs them (the pass must have run with `store_far`)."""
        args = resolve_lr_scale(replace(args), self.model)
        inputs = {i: self.stats.inputs[i] for i in mixers} if inputs is None else inputs
        weights = far_weights(self.model, self.stats, mixers, args.far_weight) if args.far_weight else None
        return align_layers(mixers, inputs, {i: self.targets[i] for i in mixers}, args, weights=weights)

    def perplexity(self, mixers: dict, heldout: Tensor, batch_size: int = 4, desc: str = "eval") -> float:
        """Held-out perplexity of the hybrid: the teacher with `mixers` swapped in (restored after)."""
        with swapped_into(self.model, mixers):
            return perplexity(self.model, heldout, batch_size, desc)["ppl"]


def build_all(tp: TeacherPass, specs: list[tuple[str, bool]], args, backend: str, policies: list[str],
              calib: torch.Tensor):
    """Phase 1 on *every* layer for each method of `specs` (plus taylor, which greedy scores with), then each
    policy's kept layers, then alignment of each aligned method on just the layers some policy converts.
    Returns (built {(method, aligned): {layer: mixer}}, alignment reports, kept, policy scores)."""
    model = tp.model
    n = model.config.num_hidden_layers
    built: dict[tuple[str, bool], dict] = {}
    align_reports = {}
    for method in dict.fromkeys(m for m, _ in specs + [("taylor", False)]):
        built[(method, False)], _ = tp.mixers(list(range(n)), method, args.calib, args.gdn, backend, args.seed)
    kept, scores = choose_layers(model, policies, built, calib, args)
    converted = sorted({i for p in policies for i in gdn_layers(kept[p], n)})
    train_backend = training_backend(backend, args.backend, any(a for _, a in specs))
    for method, aligned in specs:
        if aligned and (method, True) not in built:
            mixers = {i: copy.deepcopy(built[(method, False)][i]) for i in converted}
            for m in mixers.values():
                m.backend = train_backend
            align_reports[method] = tp.align(mixers, args.phase2)
            for m in mixers.values():
                m.backend = backend
            built[(method, True)] = mixers
    return built, align_reports, kept, scores


def choose_layers(model, policies: list[str], built: dict, calib: torch.Tensor, args):
    """Kept attention layers of each policy (bypass scored on the teacher, greedy and kl on taylor phase-1 mixers)."""
    n = model.config.num_hidden_layers
    kept, scores = {}, {}
    for policy in policies:
        if policy in ("bypass", "greedy", "kl"):
            scores[policy] = layer_scores(policy, model, built[("taylor", False)], calib[:4], args.eval_batch_size)
        kept[policy] = kept_layers(policy, n, args.keep_every, scores.get(policy), args.kv_budget)
    return kept, scores


def check_policies(policies: list[str]) -> None:
    for policy in policies:
        if policy in RETRIEVAL:
            raise ValueError(f"policy {policy!r} scores the teacher's heads on retrieval probes, which only convert "
                             f"builds: run `taylor-calibrate convert --policy {policy}` and pass the kept_layers of "
                             "its report.json here as layers=...")
        if policy not in ("uniform", "bypass", "greedy", "kl") and not policy.startswith("layers="):
            raise ValueError(f"unknown layer policy {policy!r}; use uniform, bypass, greedy, kl or layers=0,4,8")


def markdown_table(result: dict) -> str:
    policies = list(dict.fromkeys(r["policy"] for r in result["rows"]))
    inits = list(dict.fromkeys(r["init"] for r in result["rows"]))
    ppl = {(r["policy"], r["init"]): r["ppl"] for r in result["rows"]}
    lines = [f"Teacher `{result['teacher']}`: held-out PPL {result['teacher_ppl']:.3f} on {result['eval_tokens']} tokens; "
             f"{result['kept_fraction']:.0%} of layers kept as attention.", "",
             "| init | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for init in inits:
        lines.append(f"| {init} | " + " | ".join(f"{ppl[(p, init)]:,.2f}" for p in policies) + " |")
    lines += ["", "Kept layers: " + "; ".join(f"{p}: {result['kept'][p]}" for p in policies), "",
              f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


@writes_out("ablate")
def run_ablate(args: AblateArgs) -> dict:
    """Zero-shot held-out perplexity of every init on every layer policy; JSON + markdown table."""
    t0 = time.perf_counter()
    specs = [parse_init(s) for s in args.inits]  # bad specs and policies fail before any work
    check_policies(args.policies)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backend)
    profile = apply_profile(args, device.type)
    teacher = load_teacher(args.teacher, device, dtype)
    model = teacher.model
    n = model.config.num_hidden_layers
    d = args.data
    splits = load_splits(d, teacher.tokenizer, d.seq_len, d.calib_seqs, d.eval_seqs)
    teacher_ppl = perplexity(model, splits.heldout, args.eval_batch_size, "teacher ppl")
    tp = TeacherPass.run(model, splits.calib, list(range(n)), device, args.eval_batch_size,
                         store_far=args.phase2.far_weight > 0)
    built, align_reports, kept, scores = build_all(tp, specs, args, backend, args.policies, splits.calib)

    rows = []
    for policy in args.policies:
        converted = gdn_layers(kept[policy], n)
        for spec, (method, aligned) in zip(args.inits, specs):
            mixers = built[(method, aligned)]
            ppl = tp.perplexity({i: mixers[i] for i in converted}, splits.heldout, args.eval_batch_size,
                                f"{policy}/{spec}")
            rows.append({"policy": policy, "init": spec, "phase2": aligned, "ppl": ppl, "kept_layers": kept[policy]})
            print(f"  {policy:>8} {spec:>14}  ppl {ppl:,.3f}")

    result = {
        "teacher": args.teacher, "teacher_ppl": teacher_ppl["ppl"], "kept_fraction": len(kept[args.policies[0]]) / n,
        "eval_tokens": teacher_ppl["tokens"], "calib_tokens": int(splits.calib.numel()), "rows": rows, "kept": kept,
        "policy_scores": scores,
        "align": {m: {k: v for k, v in r.items() if k != "layers"} for m, r in align_reports.items()},
        "profile": profile, "backend": backend, "device": str(device), "wall_s": time.perf_counter() - t0,
    }
    out = Path(args.out)
    result = record(out / "ablation.json", result, args)
    (out / "ablation.md").write_text(markdown_table(result))
    print(markdown_table(result))
    return result
