"""Whether the kept heads' attention is flatter in the hybrid than in the teacher: the answer's teacher-forced
log-probability on evaluation probes (the ones `eval --niah` draws for --niah_seed 0) with the queries of every softmax
attention head scaled by each factor (attention logits x factor), in the hybrid and in the teacher.

    python benchmarks/kept_sharpness.py --model out/hybrid --scales 1,1.25 --lengths 1024 --out /tmp/sharp.json

A hybrid that gains from a factor above 1 where its teacher loses spreads its kept heads' attention over the haystack
more than the teacher does (its GDN layers moved the keys and queries those heads read). `--save DIR --save-scale F`
writes the hybrid with its queries scaled by F, for `eval --niah`. A diagnostic: nothing in `convert` uses it.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from taylor_calibrate.export import load_model, save_hybrid
from taylor_calibrate.model.gdn import GatedDeltaNet
from taylor_calibrate.results import record
from taylor_calibrate.retrieval import TASKS, answer_scores, eval_probes
from taylor_calibrate.teacher import load_teacher, resolve_device


def query_weights(model) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, one_plus) for every tensor that scales a softmax head's queries: the query norm's weight where the
    architecture has one (it would undo a scaled projection; `one_plus`: Gemma's norm multiplies by 1 + weight), else
    the query projection's weight and bias. GDN mixers are skipped: their queries feed no softmax."""
    one_plus = model.config.model_type.startswith("gemma")
    out = []
    for m in model.modules():
        if isinstance(m, GatedDeltaNet) or not hasattr(m, "q_proj"):
            continue
        if getattr(m, "q_norm", None) is not None and getattr(m.q_norm, "weight", None) is not None:
            out.append((m.q_norm.weight, one_plus))
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


def measure(model, tokenizer, scales, tasks, lengths, samples: int) -> list[dict]:
    """The answer's mean log-prob and accuracy per (scale, length), the model restored afterwards."""
    saved = [t.clone() for t, _ in query_weights(model)]
    probes = {n: eval_probes(tokenizer, n, samples=samples, tasks=tuple(tasks)) for n in lengths}
    rows = []
    for s in scales:
        scale_queries(model, s)
        for n in lengths:
            r = answer_scores(model, probes[n])
            rows.append({"scale": s, "length": n, "probes": len(probes[n]), "logprob": r["logprob"], "acc": r["acc"],
                         "tasks": {k: v["logprob"] for k, v in r["tasks"].items()}})
        with torch.no_grad():
            for (t, _), w in zip(query_weights(model), saved):
                t.copy_(w)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a converted hybrid's directory (convert or distill output)")
    ap.add_argument("--teacher", default=None, help="its teacher (default: the one the hybrid records); 'none' skips it")
    ap.add_argument("--scales", default="1,1.25", help="query factors to score")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--samples", type=int, default=8, help="probes per task and length")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--save", default=None, help="write the hybrid with its queries scaled by --save-scale here")
    ap.add_argument("--save-scale", type=float, default=None)
    ap.add_argument("--out", default=None, help="JSON path")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if (a.save is None) != (a.save_scale is None):
        raise SystemExit("--save and --save-scale go together")
    scales = [float(s) for s in a.scales.split(",")]
    if any(s <= 0 for s in scales) or (a.save_scale is not None and a.save_scale <= 0):
        raise SystemExit("query scales must be > 0")
    device = resolve_device(a.device)
    hybrid, tokenizer = load_model(a.model, device, torch.float32)
    if not hasattr(hybrid.config, "gdn_layers"):
        raise SystemExit(f"{a.model} is not a converted hybrid; pass the output directory of `convert`")
    tasks, lengths = a.tasks.split(","), [int(n) for n in a.lengths.split(",")]
    res = {"model": a.model, "hybrid": measure(hybrid, tokenizer, scales, tasks, lengths, a.samples)}
    spec = a.teacher or hybrid.config.teacher_name
    if spec and spec != "none":
        teacher = load_teacher(spec, device, torch.float32)
        res["teacher"] = spec
        res["teacher_rows"] = measure(teacher.model, teacher.tokenizer, scales, tasks, lengths, a.samples)
    if a.save:
        scale_queries(hybrid, a.save_scale)
        save_hybrid(hybrid, tokenizer, a.save)
        res["saved"] = {"path": a.save, "scale": a.save_scale}
    if a.out:
        res = record(a.out, res, a)
    print(json.dumps(res, indent=1, default=str))
    for who, rows in (("hybrid", res["hybrid"]), ("teacher", res.get("teacher_rows", []))):
        for r in rows:
            print(f"{who:8s} scale {r['scale']:.2f}  {r['length']:5d} tokens  log-prob {r['logprob']:.2f}  "
                  f"acc {r['acc']:.2f}")
    return res


if __name__ == "__main__":
    main()
