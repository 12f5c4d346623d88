"""`taylor-calibrate tradeoff`: the retrieval / perplexity trade-off of conversions (docs/method.md, "Retrieval").

For each KV budget x policy, a conversion (taylor + alignment unless told otherwise) and its held-out perplexity,
generation-based NIAH accuracy per task and length and teacher-forced answer log-probability, beside the teacher's;
optionally an end-to-end phase (`distill` of the whole hybrid) after each, measured as its own row. Writes
tradeoff.json after every row (a killed run keeps what it measured), then tradeoff.md and a PNG plot.
"""
from __future__ import annotations

import copy
import json
import shlex
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from taylor_calibrate.checks import writes_out
from taylor_calibrate.config import (AlignArgs, ConvertArgs, DistillArgs, TradeoffArgs, apply_profile, apply_train_profile,
                                     convert_args_of, parse_args_of)
from taylor_calibrate.convert import convert, resolve_runtime
from taylor_calibrate.data import distill_data, load_splits
from taylor_calibrate.distill import distill
from taylor_calibrate.evaluate import agreement, perplexity
from taylor_calibrate.ops import resolve_backend, training_backend
from taylor_calibrate.results import record, write_text
from taylor_calibrate.retrieval import (REPLY_KINDS, answer_scores, check_lengths, eval_probes, niah_scores,
                                       probe_length, reply_rates)
from taylor_calibrate.teacher import load_teacher, load_tokenizer, resolve_device, resolve_dtype

RESULT = "tradeoff.json"


def _niah(model, tokenizer, args: TradeoffArgs, name: str) -> dict:
    """{"niah": accuracies, "niah_<kind>": the share of replies of each `retrieval.REPLY_KINDS`, "niah_by_distance":
    the accuracy by how far back the needle sat}; every answer to <out>/answers/<name>.jsonl."""
    answers = []
    scores = niah_scores(model, tokenizer, tasks=args.niah_tasks, lengths=args.niah_lengths,
                         samples=args.niah_samples, seed=args.niah_seed, batch_size=args.eval_batch_size,
                         max_new_tokens=args.niah_new_tokens, answers=answers)
    write_text(Path(args.out) / "answers" / f"{name}.jsonl", "".join(json.dumps(a) + "\n" for a in answers))
    return {"niah": scores, **{f"niah_{kind}": reply_rates(answers, kind) for kind in REPLY_KINDS},
            "niah_by_distance": reply_rates(answers, "right", by="distance")}


def end_to_end(hybrid, teacher, row: dict, convert_args: ConvertArgs, flags: str, tag: str,
               args: TradeoffArgs, device) -> tuple[dict, object]:
    """The end-to-end phase after a conversion: `distill` of the whole hybrid toward the teacher for
    args.distill_tokens tokens with distill options `flags`, then the held-out perplexity on the zero-shot row's text.
    Returns (the row, with distill_tokens > 0; the distilled hybrid)."""
    d = parse_args_of(DistillArgs, ["--profile", convert_args.profile, *shlex.split(flags)])
    apply_profile(d, device.type)
    apply_train_profile(d.train, d.profile)
    d.train.tokens = args.distill_tokens
    out = Path(args.out)
    work = out / f"e2e_{row['policy']}_{row['kv_budget']}_{row['seed']}_{tag}"
    rows, heldout = distill_data(d.data, teacher.tokenizer, d.train.tokens)  # one tokenisation per corpus (the cache)
    dtype = next(hybrid.parameters()).dtype
    student = hybrid.float()  # fp32 master weights, as distill wants
    student.set_backend(training_backend(resolve_backend(d.backend), d.backend, True))
    rep = distill(student, teacher.model, rows, heldout, d.train, work, resume=False,
                  eval_batch_size=convert_args.eval_batch_size, desc=f"{row['policy']} end-to-end",
                  teacher_spec=convert_args.teacher)
    hybrid = student.to(dtype).eval()
    hybrid.set_backend(convert_args.backend)
    c = convert_args.data  # the zero-shot rows' held-out text, for a comparable perplexity
    splits = load_splits(c, teacher.tokenizer, c.seq_len, c.calib_seqs, c.eval_seqs)
    e2e = {**row, "distill_tokens": rep["tokens"], "distill_seq_len": rep["seq_len"],
           "distill_flags": flags, "distill_args": {"train": asdict(d.train), "data": asdict(d.data)},
           "distill": {k: rep[k] for k in ("eval_tokens", "heldout_loss", "heldout_kl", "tokens_per_s", "mfu")},
           "ppl": perplexity(hybrid, splits.heldout, convert_args.eval_batch_size, "e2e ppl")["ppl"]}
    agree = agreement(hybrid, teacher.model, splits.heldout, convert_args.eval_batch_size)
    e2e.update(kl=agree["kl"], top1=agree["top1"])
    return e2e, hybrid


def label(r: dict) -> str:
    """A row's name: its policy, its seed when not 0, the phase-2 options it departs from the defaults with (kept
    attention re-aligned, far_weight), and for an end-to-end row its row length and training flags (the `--train.*`
    part of its distill flags): rows that differ in either are told apart, in the table and in the plot's curves."""
    name = r["policy"] + (f" (seed {r['seed']})" if r.get("seed") else "")
    name += " + kept attention re-aligned" if r.get("phase2_kept_attention") else ""
    far = r.get("phase2_far_weight", 0.0)  # rows from before the option had none: 0
    name += f" + far_weight {far:g}" if far is not None and far != AlignArgs.far_weight else ""
    if not r["distill_tokens"]:
        return name
    toks = shlex.split(r["distill_flags"])
    train = " ".join(t if "=" in t or i + 1 == len(toks) or toks[i + 1].startswith("--") else f"{t} {toks[i + 1]}"
                     for i, t in enumerate(toks)
                     if t.startswith("--train.") and t.partition("=")[0] not in _SAME_RESULT)
    rows = f"{r['distill_seq_len']}-token rows" if r.get("distill_seq_len") else ""  # older results lack it
    return f"{name} + end-to-end ({', '.join(x for x in (rows, train) if x) or 'defaults'})"


_SAME_RESULT = {f"--train.{f}" for f in ("micro_batch_size", "save_every", "log_every", "eval_every", "compile")}
"""Distill flags that change how a run is carried out, not what it computes: left out of a row's name."""


def markdown(result: dict) -> str:
    lengths = [str(n) for n in result["niah_lengths"]]
    tasks = result["niah_tasks"]
    head = "| policy | granularity | KV | distill tokens | PPL (x teacher) | KL | answer log-prob | " + " | ".join(
        f"{t} {n}" for t in tasks for n in lengths) + " |"
    lines = [head, "|" + "---|" * (7 + len(tasks) * len(lengths))]

    def row(name, gran, kv, tokens, ppl, ratio, kl, lp, niah):
        cells = [f"{niah[t][n]:.2f}" if niah[t][n] is not None else "-" for t in tasks for n in lengths]
        kl = "-" if kl is None else f"{kl:.4f}"
        lines.append(f"| {name} | {gran} | {kv} | {tokens:,} | {ppl:.3f} ({ratio:.2f}x) | {kl} | {lp:.2f} | "
                     + " | ".join(cells) + " |")

    t = result["teacher"]
    row("teacher", "-", "100%", 0, t["ppl"], 1.0, 0.0, t["answer_logprob"], t["niah"])
    for r in result["rows"]:
        row(label(r), r["granularity"], f"{r['kv_fraction']:.1%}", r["distill_tokens"], r["ppl"],
            r["ppl"] / t["ppl"], r.get("kl"), r["answer_logprob"], r["niah"])
    return ("\n".join(lines) + f"\n\nAnswer log-probability: teacher-forced, at {result['logprob_length']} tokens.\n"
            + distance_table(result))


def distance_table(result: dict) -> str:
    """The NIAH accuracy by how far back the asked needle sat (`niah_by_distance`), teacher and rows, as markdown;
    empty for results from before the field."""
    named = [("teacher", result["teacher"])] + [(label(r), r) for r in result["rows"]]
    named = [(name, r["niah_by_distance"]) for name, r in named if r.get("niah_by_distance")]
    if not named:
        return ""
    tasks = result["niah_tasks"]
    bins = {t: sorted({int(b) for _, d in named for b in d.get(t, {})}) for t in tasks}
    lines = ["| model | " + " | ".join(f"{t} <={b}" for t in tasks for b in bins[t]) + " |",
             "|" + "---|" * (1 + sum(len(b) for b in bins.values()))]
    for name, d in named:
        cells = [f"{d[t][str(b)]:.2f}" if str(b) in d.get(t, {}) else "-" for t in tasks for b in bins[t]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return ("\nNIAH accuracy by how far back the asked needle sat: tokens from it to the prompt's end, each column "
            "the distances in (N/2, N] (up to 512 in the first).\n\n" + "\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 4.5))
    t = result["teacher"]

    def mean_niah(niah):
        vals = [v for cells in niah.values() for v in cells.values() if v is not None]
        return sum(vals) / len(vals)

    names = list(dict.fromkeys(label(r) for r in result["rows"]))
    colors = plt.get_cmap("tab20")(range(len(names)))
    for name, color in zip(names, colors):
        rows = sorted((r for r in result["rows"] if label(r) == name), key=lambda r: r["kv_fraction"])
        kv = [r["kv_fraction"] for r in rows]
        style = "s" if rows[0]["distill_tokens"] else "o-"  # end-to-end rows: one square each
        ax1.plot(kv, [r["ppl"] / t["ppl"] for r in rows], style, color=color, label=name)
        ax2.plot(kv, [mean_niah(r["niah"]) for r in rows], style, color=color)
    ax2.axhline(mean_niah(t["niah"]), color="k", ls="--", label="teacher")
    ax1.set(xlabel="KV cache kept (fraction of the teacher's)", ylabel="held-out PPL / teacher's", yscale="log")
    ax2.set(xlabel="KV cache kept (fraction of the teacher's)", ylabel="NIAH accuracy (mean over cells)",
            ylim=(0, 1.05))
    handles, labels = (a + b for a, b in zip(ax1.get_legend_handles_labels(), ax2.get_legend_handles_labels()))
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(0.7, 0.5), fontsize=7)
    fig.suptitle(f"{result['teacher_name']}: conversions (zero-shot, and after an end-to-end phase)")
    fig.tight_layout(rect=(0, 0, 0.7, 1))
    fig.savefig(path, dpi=120)


@writes_out("tradeoff")
def run_tradeoff(args: TradeoffArgs) -> dict:
    """Perplexity and retrieval (NIAH, teacher-forced answers) of conversions over KV budgets x policies, beside the
    teacher's; optionally after an end-to-end phase. JSON + markdown table + plot."""
    t0 = time.perf_counter()
    out = Path(args.out)
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(args.teacher)
    check_lengths(tokenizer, args.niah_tasks, args.niah_lengths, args.niah_new_tokens)
    teacher = load_teacher(args.teacher, device, resolve_dtype(args.dtype, device), tokenizer=tokenizer)
    tok = teacher.tokenizer
    base = convert_args_of(args)
    apply_profile(base, device.type)
    length = probe_length(args.logprob_length, teacher.model.config)
    long_probes = eval_probes(tok, length, samples=8, tasks=args.niah_tasks)
    result = {"teacher_name": args.teacher, "niah_tasks": args.niah_tasks, "niah_lengths": args.niah_lengths,
              "logprob_length": length,
              "teacher": {**_niah(teacher.model, tok, args, "teacher"),
                          "answer_logprob": answer_scores(teacher.model, long_probes)["logprob"]},
              "rows": []}
    runs = [(p, b, 0) for b in args.budgets for p in args.policies]
    runs += [(args.seed_policy, args.seed_budget, s) for s in args.seeds if s != 0]
    for policy, budget, seed in runs:
        conv = replace(base, policy=policy, kv_budget=budget, seed=seed, phase2=replace(base.phase2, seed=seed),
                       data=copy.copy(base.data))
        t = time.perf_counter()
        c = convert(conv, teacher, resolve_runtime(conv))
        report, hybrid = c.report, c.hybrid
        result["teacher"]["ppl"] = report["teacher_ppl"]
        row = {"policy": policy, "granularity": "head" if policy == "heads" else "layer", "kv_budget": budget,
               "context": report["context"], "kv_bytes": report["kv_bytes"], "kv_fraction": report["kv_fraction"],
               "ppl": report["hybrid_ppl"], "kl": report["agreement"]["kl"], "top1": report["agreement"]["top1"],
               "distill_tokens": 0, "seed": seed,
               "kept_layers": report["kept_layers"], "headwise_kept_groups": report["headwise_kept_groups"],
               "phase2_kept_attention": report["phase2_kept_attention"] is not None,
               "phase2_far_weight": conv.phase2.far_weight if conv.align else None,
               "answer_logprob": answer_scores(hybrid, long_probes)["logprob"],
               "probe_retrieval": report["retrieval"]["hybrid"] if report["retrieval"] else None,
               **_niah(hybrid, tok, args, f"row{len(result['rows'])}"), "convert_s": report["wall_s"]}
        row["row_s"] = time.perf_counter() - t
        result["rows"].append(row)
        result = record(out / RESULT, result, args)
        for k, flags in enumerate(args.distill if args.distill_tokens else []):
            t = time.perf_counter()
            e2e, tuned = end_to_end(copy.deepcopy(hybrid), teacher, row, conv, flags, str(k), args, device)
            e2e.update(answer_logprob=answer_scores(tuned, long_probes)["logprob"], probe_retrieval=None,
                       **_niah(tuned, tok, args, f"row{len(result['rows'])}"), row_s=time.perf_counter() - t)
            result["rows"].append(e2e)
            result = record(out / RESULT, result, args)
            del tuned
        del hybrid
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(markdown(result), flush=True)
    result["wall_s"] = time.perf_counter() - t0
    result = record(out / RESULT, result, args)
    write_text(out / "tradeoff.md", markdown(result))
    plot(result, out / "tradeoff.png")
    print(markdown(result))
    return result
