"""Where a hybrid loses a needle: per head that stays softmax attention, the attention mass the positions predicting
a retrieval answer put on the needle's copy of it, in the teacher and in the hybrid (teacher-forced evaluation
probes, the ones `eval --niah` draws for --niah_seed 0), beside the answer's log-probability in each; and the share
of the teacher's needle mass, over all its heads, that lies in the heads the hybrid keeps (`coverage`: low when the
selection left retrieval heads to GDN, high when the loss happens in heads that stayed attention).

    python benchmarks/kept_attention.py --model out/hybrid --lengths 1024,4096 --out /tmp/kept_attention.json

A kept head's weights are the teacher's, so a head whose mass falls reads queries or keys that the GDN layers before
it changed; a head that keeps its mass while the answer is still lost points past the attention, to how its output
is read. Only the heads with at least --min-mass of the teacher's attention on the needle (its retrieval heads) are
listed. Prints JSON and a table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from taylor_calibrate.checkpoint import load_model
from taylor_calibrate.model.hybrid import kept_heads
from taylor_calibrate.results import record
from taylor_calibrate.retrieval import TASKS, answer_scores, eval_probes
from taylor_calibrate.stats import needle_mass
from taylor_calibrate.teacher import load_teacher, resolve_device


def measure(hybrid, teacher, tokenizer, tasks, lengths, samples: int, min_mass: float) -> list[dict]:
    """One cell per (task, length): the answer's mean log-prob in both models, the retrieval heads' needle mass, and
    the kept heads' share of the teacher's needle mass over all heads."""
    layers = hybrid.config.gdn_layers
    kept = kept_heads(teacher.config, layers, {i: hybrid.config.kept_groups(i) for i in layers})
    cells = []
    for task in tasks:
        for n in lengths:
            probes = eval_probes(tokenizer, n, samples=samples, tasks=(task,))
            t, h = needle_mass(teacher, probes), needle_mass(hybrid, probes)
            heads = []
            for i, idx in kept.items():
                for j, head in enumerate(idx):  # j: the head's index in the hybrid's module (kept heads only)
                    tm, hm = float(t[i][:, head].mean()), float(h[i][:, j].mean())
                    if tm >= min_mass:
                        heads.append({"layer": i, "head": head, "teacher": tm, "hybrid": hm})
            kept_share = sum(x["hybrid"] for x in heads) / max(sum(x["teacher"] for x in heads), 1e-9)
            total = sum(float(m.mean(0).sum()) for m in t.values())
            coverage = sum(float(t[i].mean(0)[idx].sum()) for i, idx in kept.items()) / max(total, 1e-9)
            cells.append({"task": task, "length": n, "probes": len(probes), "coverage": coverage,
                          "teacher_logprob": answer_scores(teacher, probes)["logprob"],
                          "hybrid_logprob": answer_scores(hybrid, probes)["logprob"],
                          "kept_share": kept_share, "heads": heads})
    return cells


def table(cells: list[dict]) -> str:
    lines = ["| task | length | answer log-prob teacher / hybrid | teacher's needle mass in kept heads | needle mass "
             "kept (hybrid / teacher, retrieval heads) | heads: layer.head teacher > hybrid |",
             "|---|---|---|---|---|---|"]
    for c in cells:
        heads = ", ".join(f"{x['layer']}.{x['head']} {x['teacher']:.2f} > {x['hybrid']:.2f}" for x in c["heads"])
        lines.append(f"| {c['task']} | {c['length']} | {c['teacher_logprob']:.2f} / {c['hybrid_logprob']:.2f} | "
                     f"{c['coverage']:.2f} | {c['kept_share']:.2f} | {heads} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a converted hybrid's directory (convert or distill output)")
    ap.add_argument("--teacher", default=None, help="its teacher (default: the one the hybrid records)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--samples", type=int, default=8, help="probes per task and length")
    ap.add_argument("--min-mass", type=float, default=0.1, help="list heads with at least this teacher mass")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="JSON path (a .md table is written beside it)")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    device = resolve_device(a.device)
    hybrid, _ = load_model(a.model, device, torch.float32)
    if not hasattr(hybrid.config, "gdn_layers"):
        raise SystemExit(f"{a.model} is not a converted hybrid; pass the output directory of `convert`")
    spec = a.teacher or hybrid.config.teacher_name
    if not spec:
        raise SystemExit(f"{a.model} does not record its teacher; pass --teacher")
    teacher = load_teacher(spec, device, torch.float32)
    cells = measure(hybrid, teacher.model, teacher.tokenizer, a.tasks.split(","),
                    [int(n) for n in a.lengths.split(",")], a.samples, a.min_mass)
    res = {"model": a.model, "teacher": spec, "cells": cells}
    md = table(cells)
    if a.out:
        res = record(a.out, res, a)
        Path(a.out).with_suffix(".md").write_text(md + "\n")
    print(json.dumps(res, indent=1, default=str))
    print(md)
    return res


if __name__ == "__main__":
    main()
