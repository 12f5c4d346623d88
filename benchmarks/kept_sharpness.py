"""Whether the kept heads' attention is flatter in the hybrid than in the teacher: the answer's teacher-forced
log-probability on evaluation probes (the ones `eval --niah` draws for --niah_seed 0) with the queries of every softmax
attention head scaled by each factor (attention logits x factor), in the hybrid and in the teacher.

    python benchmarks/kept_sharpness.py --model out/hybrid --scales 1,1.25 --lengths 1024 --out /tmp/sharp.json

A hybrid that gains from a factor above 1 where its teacher loses spreads its kept heads' attention over the haystack
more than the teacher does (its GDN layers moved the keys and queries those heads read). `--save DIR --save-scale F`
writes the hybrid with its queries scaled by F, for `eval --niah`.

`--match-entropy N` fits one factor per kept head instead, from the teacher's own attention: the factor at which the
head's mean attention entropy on N calibration rows of --fit-len tokens (the last half of each row's queries), in the
hybrid, equals the teacher's; `--save DIR` then writes the hybrid with those factors (architectures whose query
projection is per head, without a shared query norm). A diagnostic: nothing in `convert` uses it (neither scaling
helped the H200 hybrid: docs/decisions.md, "Flatter kept attention").
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from taylor_calibrate.config import DataArgs
from taylor_calibrate.data import load_splits
from taylor_calibrate.checkpoint import load_model, save_hybrid
from taylor_calibrate.model.mixers.gdn import GatedDeltaNet
from taylor_calibrate.model.hybrid import head_dim_of, kept_heads
from taylor_calibrate.results import record
from taylor_calibrate.retrieval import TASKS, answer_scores, eval_probes
from taylor_calibrate.stats import observing, row_scores
from taylor_calibrate.teacher import load_teacher, resolve_device

GRID = (0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.45, 1.6, 1.8, 2.0)
"""Query factors the entropy match interpolates between (a head outside them gets the nearest end)."""


def softmax_attention(model) -> list:
    """The modules that run softmax attention: those with a query projection, GDN mixers excepted."""
    return [m for m in model.modules() if hasattr(m, "q_proj") and not isinstance(m, GatedDeltaNet)]


def query_weights(model) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, one_plus) for every tensor that scales a softmax head's queries: the query norm's weight where the
    architecture has one (it would undo a scaled projection; `one_plus`: Gemma's norm multiplies by 1 + weight, told
    by its class, since a hybrid's own model_type is taylor_hybrid), else the query projection's weight and bias.
    GDN mixers are skipped: their queries feed no softmax."""
    out = []
    for m in softmax_attention(model):
        if getattr(m, "q_norm", None) is not None and getattr(m.q_norm, "weight", None) is not None:
            out.append((m.q_norm.weight, type(m.q_norm).__name__.startswith("Gemma")))
        else:
            out += [(t, False) for t in (m.q_proj.weight, m.q_proj.bias) if t is not None]
    return out


@torch.no_grad()
def scale_queries(model, factor: float) -> int:
    """Multiply every softmax head's queries by `factor` in place; returns the number of tensors changed."""
    tensors = query_weights(model)
    if not tensors:
        raise ValueError(f"{type(model).__name__} has no softmax attention with a q_proj to scale")
    for t, one_plus in tensors:
        t.copy_((1 + t) * factor - 1 if one_plus else t * factor)
    return len(tensors)


def measure(model, probes: dict, scales) -> list[dict]:
    """The answer's mean log-prob and accuracy on {length: probes} per scale, the model restored afterwards."""
    saved = [t.clone() for t, _ in query_weights(model)]
    rows = []
    for s in scales:
        scale_queries(model, s)
        for n in probes:
            r = answer_scores(model, probes[n])
            rows.append({"scale": s, "length": n, "probes": len(probes[n]), "logprob": r["logprob"], "acc": r["acc"],
                         "tasks": {k: v["logprob"] for k, v in r["tasks"].items()}})
        with torch.no_grad():
            for (t, _), w in zip(query_weights(model), saved):
                t.copy_(w)
    return rows


class _Entropy:
    """Per layer, (factors, heads): the mean attention entropy of every 4th query in the last half of each row, with
    the logits scaled by each factor (a `stats.observing` collector)."""

    def __init__(self, factors):
        self.factors, self.sums = factors, {}

    def observe(self, module, query, key, out, scaling, window, softcap):
        t = query.shape[2]
        s = row_scores(query, key, torch.arange(t // 2, t, 4, device=query.device), scaling, window, softcap)
        ent = []
        for f in self.factors:
            p = (s * f).softmax(-1)
            ent.append(-(p * p.clamp_min(1e-30).log()).sum(-1).mean((0, 2)))
        self.sums[module.layer_idx] = self.sums.get(module.layer_idx, 0) + torch.stack(ent).cpu()


@torch.no_grad()
def entropies(model, rows: torch.Tensor, factors) -> dict[int, torch.Tensor]:
    """{layer: (factors, heads)} mean attention entropy over `rows` (N, T) of every softmax module `model` runs."""
    c = _Entropy(list(factors))
    device = next(model.parameters()).device
    with observing(model, c):
        for r in rows:
            model(input_ids=r[None].to(device), use_cache=False, logits_to_keep=1)
    return {i: v / len(rows) for i, v in c.sums.items()}


def crossing(grid, curve: torch.Tensor, target: float) -> float:
    """The factor at which `curve` (entropy at each grid factor, falling) meets `target`, linear between grid
    points; the nearest end of the grid when it never does."""
    for a in range(len(grid) - 1):
        hi, lo = float(curve[a]), float(curve[a + 1])
        if hi >= target >= lo:
            return grid[a] + (hi - target) / max(hi - lo, 1e-12) * (grid[a + 1] - grid[a])
    return grid[0] if target > float(curve[0]) else grid[-1]


def matched_factors(hybrid, teacher, rows: torch.Tensor, grid=GRID) -> dict[int, list[float]]:
    """{layer: one factor per kept head, in the hybrid module's order} matching the teacher's attention entropy."""
    layers = hybrid.config.gdn_layers
    kept = kept_heads(teacher.config, layers, {i: hybrid.config.kept_groups(i) for i in layers})
    te, he = entropies(teacher, rows, [1.0]), entropies(hybrid, rows, grid)
    return {i: [crossing(grid, he[i][:, j], float(te[i][0, h])) for j, h in enumerate(heads)]
            for i, heads in sorted(kept.items())}


@torch.no_grad()
def scale_heads(hybrid, factors: dict[int, list[float]]) -> None:
    """Multiply each kept head's rows of its layer's query projection by its factor, in place."""
    hd = head_dim_of(hybrid.config)
    mods = {m.layer_idx: m for m in softmax_attention(hybrid)}
    for i, fs in factors.items():
        m = mods[i]
        if getattr(m, "q_norm", None) is not None:
            raise ValueError(f"layer {i} normalises its queries with one q_norm shared by its heads: per-head "
                             "factors cannot be written into its weights; use --save-scale")
        for j, f in enumerate(fs):
            for t in (m.q_proj.weight, m.q_proj.bias):
                if t is not None:
                    t[j * hd:(j + 1) * hd] *= f


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a converted hybrid's directory (convert or distill output)")
    ap.add_argument("--teacher", default=None,
                    help="its teacher (default: the one the hybrid records); 'none' skips it")
    ap.add_argument("--scales", default="1,1.25", help="query factors to score")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--samples", type=int, default=8, help="probes per task and length")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--save", default=None, help="write the scaled hybrid here (--save-scale or --match-entropy)")
    ap.add_argument("--save-scale", type=float, default=None)
    ap.add_argument("--match-entropy", type=int, default=0, help="fit per-head factors on this many calibration rows")
    ap.add_argument("--fit-len", type=int, default=2048, help="tokens per calibration row for --match-entropy")
    ap.add_argument("--data", default="builtin", help="corpus of the calibration rows (a `--data.source` value)")
    ap.add_argument("--out", default=None, help="JSON path")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if a.save_scale is not None and a.match_entropy:
        raise SystemExit("--save-scale and --match-entropy are two ways to scale: pass one")
    if a.save and a.save_scale is None and not a.match_entropy:
        raise SystemExit("--save needs --save-scale F or --match-entropy N (how to scale)")
    if a.save_scale is not None and not a.save:
        raise SystemExit("--save-scale needs --save DIR (where to write the scaled hybrid)")
    scales = [float(s) for s in a.scales.split(",")]
    if any(s <= 0 for s in scales) or (a.save_scale is not None and a.save_scale <= 0):
        raise SystemExit("query scales must be > 0")
    device = resolve_device(a.device)
    hybrid, tokenizer = load_model(a.model, device, torch.float32)
    if not hasattr(hybrid.config, "gdn_layers"):
        raise SystemExit(f"{a.model} is not a converted hybrid; pass the output directory of `convert`")
    tasks, lengths = a.tasks.split(","), [int(n) for n in a.lengths.split(",")]
    probes = {n: eval_probes(tokenizer, n, samples=a.samples, tasks=tuple(tasks)) for n in lengths}  # one set for all
    res = {"model": a.model, "hybrid": measure(hybrid, probes, scales)}
    spec = a.teacher or hybrid.config.teacher_name
    teacher = None
    if spec and spec != "none":
        teacher = load_teacher(spec, device, torch.float32)
        res["teacher"] = spec
        res["teacher_rows"] = measure(teacher.model, probes, scales)
    if a.match_entropy:
        if teacher is None:
            raise SystemExit("--match-entropy needs the teacher")
        rows = load_splits(DataArgs(source=a.data), tokenizer, a.fit_len, a.match_entropy, 1).calib
        factors = matched_factors(hybrid, teacher.model, rows)
        res["matched_factors"] = {str(i): fs for i, fs in factors.items()}
        scale_heads(hybrid, factors)
        res["matched"] = measure(hybrid, probes, [1.0])
        if a.save:
            save_hybrid(hybrid, tokenizer, a.save)
            res["saved"] = {"path": a.save, "factors": "matched_factors"}
    elif a.save:
        scale_queries(hybrid, a.save_scale)
        save_hybrid(hybrid, tokenizer, a.save)
        res["saved"] = {"path": a.save, "scale": a.save_scale}
    if a.out:
        res = record(a.out, res, a)
    print(json.dumps(res, indent=1, default=str))
    for who, rows in (("hybrid", res["hybrid"]), ("teacher", res.get("teacher_rows", [])),
                      ("matched", res.get("matched", []))):
        for r in rows:
            print(f"{who:8s} scale {r['scale']:.2f}  {r['length']:5d} tokens  log-prob {r['logprob']:.2f}  "
                  f"acc {r['acc']:.2f}")
    return res


if __name__ == "__main__":
    main()
