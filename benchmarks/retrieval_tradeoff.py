"""The retrieval / perplexity trade-off of a conversion: for each KV budget x layer policy, the zero-shot hybrid's
held-out perplexity, generation-based NIAH accuracy (single, multikey, passkey at several lengths) and teacher-forced
answer log-probability, beside the teacher's. Writes JSON (+ a markdown table and a PNG plot) and prints the table.

    python benchmarks/retrieval_tradeoff.py --teacher smollm2-135m --budgets 0.125 0.25 0.5 \\
        --policies uniform bypass retrieval heads --out retrieval_smollm2.json
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import shlex
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from taylor_calibrate.config import apply_profile, apply_train_profile
from taylor_calibrate.convert import convert_loaded
from taylor_calibrate.data import distill_data, load_splits
from taylor_calibrate.distill import distill
from taylor_calibrate.evaluate import perplexity
from taylor_calibrate.ops import training_backend
from taylor_calibrate.results import record, write_text
from taylor_calibrate.retrieval import answer_scores, eval_probes, niah_scores
from taylor_calibrate.teacher import load_teacher, resolve_device, resolve_dtype


def niah_of(model, tokenizer, a) -> dict:
    return niah_scores(model, tokenizer, tasks=a.tasks, lengths=a.lengths, samples=a.samples, seed=a.niah_seed,
                       batch_size=a.niah_batch)


def end_to_end(hybrid, teacher, row: dict, convert_args, flags: str, tag: str, a, device) -> tuple[dict, object]:
    """The end-to-end phase after conversion (`distill` of the whole hybrid toward the teacher for --distill-tokens
    tokens, distill options `flags`), then the held-out perplexity of the zero-shot row's text: (row with
    distill_tokens > 0, the distilled hybrid)."""
    from taylor_calibrate.cli import parse

    _, d = parse(["distill", "--profile", convert_args.profile, *shlex.split(flags)])
    apply_profile(d, device.type)
    apply_train_profile(d.train, d.profile)
    d.train.tokens = a.distill_tokens
    work = Path(a.out).with_suffix("") / f"e2e_{row['policy']}_{row['kv_budget']}_{row['seed']}_{tag}"
    corpus = json.dumps([d.data.source, d.data.text_field, d.data.split, d.data.heldout_fraction])
    shards = Path(a.out).with_suffix("") / f"tokens_{hashlib.sha1(corpus.encode()).hexdigest()[:8]}"  # one per corpus
    rows, heldout = distill_data(d.data, teacher.tokenizer, shards, d.train.tokens)
    dtype = next(hybrid.parameters()).dtype
    student = hybrid.float()
    student.set_backend(training_backend(student.set_backend(d.backend), d.backend, True))
    rep = distill(student, teacher.model, rows, heldout, d.train, work, resume=False,
                  eval_batch_size=convert_args.eval_batch_size, desc=f"{row['policy']} end-to-end",
                  teacher_spec=convert_args.teacher)
    hybrid = student.to(dtype).eval()
    hybrid.set_backend(convert_args.backend)
    c = convert_args.data  # the zero-shot rows' held-out text, for a comparable perplexity
    splits = load_splits(c, teacher.tokenizer, c.seq_len, c.calib_seqs, c.eval_seqs)
    out = {**row, "distill_tokens": rep["tokens"], "distill_seq_len": rep["seq_len"],
           "distill_flags": flags, "distill_args": {"train": asdict(d.train), "data": asdict(d.data)},
           "distill": {k: rep[k] for k in ("eval_tokens", "heldout_loss", "heldout_kl", "tokens_per_s", "mfu")},
           "ppl": perplexity(hybrid, splits.heldout, convert_args.eval_batch_size, "e2e ppl")["ppl"]}
    return out, hybrid


def label(r: dict) -> str:
    """A row's name: its policy, its seed when not 0, and for an end-to-end row the phase's repeated-span fraction."""
    name = r["policy"] + (f" (seed {r['seed']})" if r.get("seed") else "")
    if not r["distill_tokens"]:
        return name
    return f"{name} + end-to-end (repeat_spans {r['distill_args']['train']['repeat_spans']})"


def markdown(result: dict) -> str:
    lengths = [str(n) for n in result["args"]["lengths"]]
    tasks = result["args"]["tasks"]
    head = "| policy | granularity | KV | distill tokens | PPL (x teacher) | answer log-prob (4K) | " + " | ".join(
        f"{t} {n}" for t in tasks for n in lengths) + " |"
    lines = [head, "|" + "---|" * (6 + len(tasks) * len(lengths))]

    def row(name, gran, kv, tokens, ppl, ratio, lp, niah):
        cells = [f"{niah[t][n]:.2f}" if niah[t][n] is not None else "-" for t in tasks for n in lengths]
        lines.append(f"| {name} | {gran} | {kv} | {tokens:,} | {ppl:.3f} ({ratio:.2f}x) | {lp:.2f} | "
                     + " | ".join(cells) + " |")

    t = result["teacher"]
    row("teacher", "-", "100%", 0, t["ppl"], 1.0, t["answer_logprob"], t["niah"])
    for r in result["rows"]:
        row(label(r), r["granularity"], f"{r['kv_fraction']:.1%}", r["distill_tokens"], r["ppl"],
            r["ppl"] / t["ppl"], r["answer_logprob"], r["niah"])
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    t = result["teacher"]

    def mean_niah(niah):
        vals = [v for cells in niah.values() for v in cells.values() if v is not None]
        return sum(vals) / len(vals)

    for name in dict.fromkeys(label(r) for r in result["rows"]):
        rows = sorted((r for r in result["rows"] if label(r) == name), key=lambda r: r["kv_fraction"])
        kv = [r["kv_fraction"] for r in rows]
        ax1.plot(kv, [r["ppl"] / t["ppl"] for r in rows], "o-", label=name)
        ax2.plot(kv, [mean_niah(r["niah"]) for r in rows], "o-", label=name)
    ax2.axhline(mean_niah(t["niah"]), color="k", ls="--", label="teacher")
    ax1.set(xlabel="KV cache kept (fraction of the teacher's)", ylabel="held-out PPL / teacher's", yscale="log")
    ax2.set(xlabel="KV cache kept (fraction of the teacher's)", ylabel="NIAH accuracy (mean over cells)", ylim=(0, 1.05))
    ax2.legend(fontsize=8)
    fig.suptitle(f"{result['args']['teacher']}: conversions (zero-shot, and after an end-to-end phase)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.125, 0.25, 0.5])
    ap.add_argument("--policies", nargs="+", default=["uniform", "bypass", "retrieval", "heads"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="alignment seeds (each a row)")
    ap.add_argument("--seed-policy", default="heads", help="the policy that --seeds repeats at --seed-budget")
    ap.add_argument("--seed-budget", type=float, default=0.25)
    ap.add_argument("--tasks", nargs="+", default=["single", "multikey", "passkey"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--samples", type=int, default=20, help="NIAH prompts per cell")
    ap.add_argument("--niah-seed", type=int, default=0)
    ap.add_argument("--niah-batch", type=int, default=10)
    ap.add_argument("--logprob-length", type=int, default=4096, help="length of the teacher-forced answer probes")
    ap.add_argument("--profile", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--convert", default="", help="extra convert flags, e.g. '--phase2.steps 600'")
    ap.add_argument("--distill-tokens", type=int, default=0,
                    help="after each zero-shot row, an end-to-end phase of this many tokens (distill) and its row")
    ap.add_argument("--distill", nargs="+", default=[""], help="distill flags of the end-to-end phase, e.g. "
                    "'--train.repeat_spans 0.5 --data.source pysrc --data.seq_len 4096'; several: one phase (and row) "
                    "each, every one from the same zero-shot hybrid")
    ap.add_argument("--out", default="retrieval_smollm2.json")
    a = ap.parse_args(argv)

    from taylor_calibrate.cli import parse
    _, base = parse(["convert", "--teacher", a.teacher, "--profile", a.profile, "--device", a.device,
                     *shlex.split(a.convert)])
    device = resolve_device(base.device)
    teacher = load_teacher(base.teacher, device, resolve_dtype(base.dtype, device))
    tok = teacher.tokenizer
    long_probes = eval_probes(tok, a.logprob_length, samples=8, tasks=a.tasks)
    t0 = time.perf_counter()
    result = {"teacher": {"niah": niah_of(teacher.model, tok, a),
                          "answer_logprob": answer_scores(teacher.model, long_probes)["logprob"]},
              "rows": []}
    runs = [(p, b, 0) for b in a.budgets for p in a.policies]
    runs += [(a.seed_policy, a.seed_budget, s) for s in a.seeds if s != 0]
    for policy, budget, seed in runs:
        args = replace(base, policy=policy, kv_budget=budget, seed=seed,
                       phase2=replace(base.phase2, seed=seed))
        t = time.perf_counter()
        report, hybrid = convert_loaded(args, teacher, save=False, return_model=True)
        if "ppl" not in result["teacher"]:
            result["teacher"]["ppl"] = report["teacher_ppl"]
        row = {"policy": policy, "granularity": "head" if policy == "heads" else "layer", "kv_budget": budget,
               "kv_fraction": report["kv_fraction"], "ppl": report["hybrid_ppl"], "distill_tokens": 0, "seed": seed,
               "kept_layers": report["kept_layers"], "headwise_kept_groups": report["headwise_kept_groups"],
               "answer_logprob": answer_scores(hybrid, long_probes)["logprob"],
               "probe_retrieval": report["retrieval"]["hybrid"], "niah": niah_of(hybrid, tok, a),
               "convert_s": report["wall_s"], "row_s": None}
        row["row_s"] = time.perf_counter() - t
        result["rows"].append(row)
        result["convert_args"] = asdict(args)
        for k, flags in enumerate(a.distill if a.distill_tokens else []):
            result = record(a.out, result, a)
            t = time.perf_counter()
            e2e, tuned = end_to_end(copy.deepcopy(hybrid), teacher, row, args, flags, f"{k}", a, device)
            e2e.update(answer_logprob=answer_scores(tuned, long_probes)["logprob"],
                       probe_retrieval=None, niah=niah_of(tuned, tok, a), row_s=time.perf_counter() - t)
            result["rows"].append(e2e)
            del tuned
        del hybrid
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        result = record(a.out, result, a)  # after every row: a killed run keeps what it measured
        print(markdown(result), flush=True)
    result["wall_s"] = time.perf_counter() - t0
    result = record(a.out, result, a)
    write_text(Path(a.out).with_suffix(".md"), markdown(result))
    plot(result, Path(a.out).with_suffix(".png"))
    print(markdown(result))


if __name__ == "__main__":
    main()
