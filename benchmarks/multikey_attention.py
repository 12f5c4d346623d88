"""Where multikey's look-alike needles get told apart: per attention layer and query head, the attention mass from
two kinds of positions onto the asked needle against the three distractor needles ("The special magic number for
KEY is: NUMBER.", same frame, different key and number), in a teacher and optionally in its hybrid, on the
teacher-forced multikey probes `eval --niah` draws for --niah_seed 0.

- rows `answer`: the positions that predict the answer's tokens; where a head reads the number from.
- rows `question`: the question's key tokens ("... number for KEY mentioned ..."); a head that attends from
  there to the asked needle's key matches the key before the number is read.
Spans: the asked needle's number and key tokens, and the distractors' (summed over the three). `pick` is
asked / (asked + distractors) for numbers from answer rows: 1 reads only the right needle, 0.25 reads all four
alike. A hybrid's kept heads are measured with the same probes; a kept head whose pick falls reads inputs that
the GDN layers before it mixed up.

    python benchmarks/multikey_attention.py --teacher smollm2-135m --lengths 1024,2048 --out /tmp/mk.json
    python benchmarks/multikey_attention.py --model out/hybrid --lengths 1024 --out /tmp/mk_hybrid.json

Prints JSON and a table of the heads with at least --min-mass of the teacher's answer-row mass on the numbers.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from taylor_calibrate.checkpoint import load_model
from taylor_calibrate.model.hybrid import kept_heads
from taylor_calibrate.results import record
from taylor_calibrate.retrieval import PROBE_ROOM, answer_scores, make_probe, make_samples, token_positions
from taylor_calibrate.stats import observing, row_scores
from taylor_calibrate.teacher import load_teacher, resolve_device

NEEDLE = re.compile(r"The special magic number for (\S+) is: (\d+)\.")
SPANS = ("asked_number", "other_numbers", "asked_key", "other_keys")
ROWS = ("answer", "question")


def locate(sample, tokenizer):
    """(probe, {row set: positions}, {span: positions}) for one multikey sample."""
    probe = make_probe(sample, tokenizer)
    text = sample.prompt + " " + sample.answer
    offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    found = {s: [] for s in SPANS}
    for m in NEEDLE.finditer(sample.prompt):
        asked = m.group(0) == sample.needle
        found["asked_key" if asked else "other_keys"].append(m.span(1))
        found["asked_number" if asked else "other_numbers"].append(m.span(2))
    q_key = sample.prompt.rfind(" for ") + 5  # the question's key: the last "for KEY" in the prompt
    q_end = sample.prompt.index(" ", q_key)
    spans = {s: token_positions(offsets, v) for s, v in found.items()}
    rows = {"answer": [i - 1 for i in probe.answer], "question": token_positions(offsets, [(q_key, q_end)])}
    if not all(spans.values()) or not rows["question"]:
        raise ValueError("could not locate every needle span in a multikey probe")
    return probe, rows, spans


class _SpanMass:
    """Per layer and query head, the attention mass from each row set onto each span (set `rows`, `spans`)."""

    def __init__(self):
        self.inputs, self.store_device = {}, "cpu"
        self.rows: dict[str, torch.Tensor] = {}
        self.spans: dict[str, torch.Tensor] = {}
        self.last: dict[int, dict] = {}

    def observe(self, module, query, key, out, scaling, window, softcap):
        res = {}
        for r, rows in self.rows.items():
            p = row_scores(query, key, rows, scaling, window, softcap).softmax(-1)[0]  # (H, r, T)
            res[r] = {s: p[..., idx].sum(-1).mean(-1).cpu() for s, idx in self.spans.items()}  # (H,)
        self.last[module.layer_idx] = res


@torch.no_grad()
def span_mass(model, located) -> dict[int, dict]:
    """{layer: {row set: {span: (probes, heads)}}} over the located probes."""
    probe = _SpanMass()
    device = next(model.parameters()).device
    out: dict[int, dict] = {}
    with observing(model, probe):
        for p, rows, spans in located:
            probe.rows = {k: torch.tensor(v, device=device) for k, v in rows.items()}
            probe.spans = {k: torch.tensor(v, device=device) for k, v in spans.items()}
            model(input_ids=torch.tensor([p.ids], device=device), use_cache=False, logits_to_keep=1)
            for i, res in probe.last.items():
                for r, d in res.items():
                    for s, m in d.items():
                        out.setdefault(i, {}).setdefault(r, {}).setdefault(s, []).append(m)
            probe.last = {}
    return {i: {r: {s: torch.stack(v) for s, v in d.items()} for r, d in rd.items()} for i, rd in sorted(out.items())}


def summarise(masses: dict, heads: dict[int, list[int]] | None = None) -> dict:
    """{"layer.head": {row: {span: mean mass}, "pick": ...}}; `heads` maps a hybrid's kept modules to the teacher's
    head numbers (module index -> teacher head)."""
    res = {}
    for i, rd in masses.items():
        n = next(iter(rd["answer"].values())).shape[1]
        for j in range(n):
            h = heads[i][j] if heads else j
            cell = {r: {s: float(rd[r][s][:, j].mean()) for s in SPANS} for r in ROWS}
            a = cell["answer"]
            cell["pick"] = a["asked_number"] / max(a["asked_number"] + a["other_numbers"], 1e-9)
            q = cell["question"]
            cell["key_pick"] = q["asked_key"] / max(q["asked_key"] + q["other_keys"], 1e-9)
            res[f"{i}.{h}"] = cell
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default=None, help="teacher spec (default: the one --model records)")
    ap.add_argument("--model", default=None, help="a converted hybrid's directory, measured beside its teacher")
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--samples", type=int, default=8, help="probes per length")
    ap.add_argument("--min-mass", type=float, default=0.1,
                    help="list heads whose teacher answer rows put at least this on the four numbers")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="JSON path (a .md table is written beside it)")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    device = resolve_device(a.device)
    hybrid = None
    if a.model:
        hybrid, _ = load_model(a.model, device, torch.float32)
        if not hasattr(hybrid.config, "gdn_layers"):
            raise SystemExit(f"{a.model} is not a converted hybrid; pass the output directory of `convert`")
    spec = a.teacher or (hybrid.config.teacher_name if hybrid is not None else None)
    if not spec:
        raise SystemExit("pass --teacher (or --model of a hybrid that records its teacher)")
    teacher = load_teacher(spec, device, torch.float32)
    kept = None
    if hybrid is not None:
        layers = hybrid.config.gdn_layers
        kept = kept_heads(teacher.model.config, layers, {i: hybrid.config.kept_groups(i) for i in layers})
    cells = []
    for n in [int(x) for x in a.lengths.split(",")]:
        samples = make_samples("multikey", teacher.tokenizer, n, a.samples, 0, PROBE_ROOM)
        located = [locate(s, teacher.tokenizer) for s in samples]
        probes = [p for p, _, _ in located]
        cell = {"length": n, "probes": len(probes),
                "teacher_logprob": answer_scores(teacher.model, probes)["logprob"],
                "teacher": summarise(span_mass(teacher.model, located))}
        if hybrid is not None:
            cell["hybrid_logprob"] = answer_scores(hybrid, probes)["logprob"]
            cell["hybrid"] = summarise(span_mass(hybrid, located), kept)
        cells.append(cell)
    lines = ["| length | head | teacher: numbers / pick, key pick | hybrid: numbers / pick, key pick |",
             "|---|---|---|---|"]
    for c in cells:
        for h, t in c["teacher"].items():
            nums = t["answer"]["asked_number"] + t["answer"]["other_numbers"]
            if nums < a.min_mass:
                continue
            hy = c.get("hybrid", {}).get(h)
            hs = (f"{hy['answer']['asked_number'] + hy['answer']['other_numbers']:.2f} / {hy['pick']:.2f}, "
                  f"{hy['key_pick']:.2f}") if hy else ("GDN" if hybrid is not None else "")
            lines.append(f"| {c['length']} | {h} | {nums:.2f} / {t['pick']:.2f}, {t['key_pick']:.2f} | {hs} |")
    md = "\n".join(lines)
    res = {"model": a.model, "teacher": spec, "cells": cells}
    if a.out:
        res = record(a.out, res, a)
        Path(a.out).with_suffix(".md").write_text(md + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "cells"}, indent=1, default=str))
    print(md)
    return res


if __name__ == "__main__":
    main()
