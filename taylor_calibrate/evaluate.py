"""The `eval` stage and its measures: perplexity on held-out text, agreement with the teacher, long-context retrieval
(retrieval.py) and lm-eval tasks on the in-memory model.

Perplexity protocol: the held-out documents are packed into non-overlapping rows of `seq_len` tokens
(`data.pack_tokens`); each row is scored on its own from position 0, every token but the first predicted from
its in-row prefix (no stride, no carried context). PPL = exp(mean token NLL over all scored tokens).
The same rows score teacher and hybrid, so their figures compare directly.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from taylor_calibrate.checks import check_context, check_same_vocab, writes_out
from taylor_calibrate.config import EvalArgs, apply_profile
from taylor_calibrate.data import load_splits
from taylor_calibrate.checkpoint import REPORT, REWRITE, check_model_type, load_model
from taylor_calibrate.model.loading import read_json
from taylor_calibrate.results import is_output_of, record, write_text
from taylor_calibrate.ops import resolve_backend
from taylor_calibrate.retrieval import REPLY_KINDS, check_lengths, niah_scores, reply_rates
from taylor_calibrate.teacher import load_teacher, resolve_device, resolve_dtype

NIAH_ANSWERS = "niah_answers.jsonl"
"""`eval --niah`: every prompt's answer (model and teacher), and whether it was right or a distractor's."""


def check_finite_eval(results: dict[str, float], fix: str) -> None:
    """A perplexity that is NaN or inf is a broken model, not a figure to report."""
    for who, ppl in results.items():
        if not math.isfinite(ppl):
            raise ValueError(f"{who} perplexity is {ppl} on the held-out text: its outputs are not finite; {fix}")


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, batch_size: int = 4, desc: str = "eval") -> dict:
    """Returns {"ppl", "nll", "tokens"} for `tokens` (N, T) under a causal LM."""
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"perplexity needs (num_seqs, seq_len >= 2) tokens, got shape {tuple(tokens.shape)}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in tqdm(range(0, tokens.shape[0], batch_size), desc=desc, leave=False):
        ids = tokens[i:i + batch_size].to(device)
        total += nll_sum(model(input_ids=ids, use_cache=False).logits, ids)
        count += ids[:, 1:].numel()
    model.train(was_training)
    nll = total / count
    return {"ppl": math.exp(nll) if nll < 700 else float("inf"), "nll": nll, "tokens": count}


@torch.no_grad()
def nll_sum(logits: torch.Tensor, ids: torch.Tensor, chunk: int = 1024) -> float:
    """Summed next-token negative log-likelihood of rows `ids` (B, T) under their `logits` (B, T, V), in nats: position
    t predicts ids[:, t + 1]. `chunk` positions at a time go to fp32, so a batch of long rows never needs an fp32 copy
    of all its logits."""
    total = logits.new_zeros((), dtype=torch.float32)
    n = ids.shape[1] - 1  # positions that predict a token
    for row, target in zip(logits, ids):
        for j in range(0, n, chunk):
            end = min(j + chunk, n)
            total += F.cross_entropy(row[j:end].float(), target[j + 1:end + 1], reduction="sum")
    return total.item()


@torch.no_grad()
def kl_sum(p: torch.Tensor, q: torch.Tensor, chunk: int = 1024) -> tuple[float, int]:
    """KL(softmax(p) || softmax(q)) summed over the positions of logits p, q (..., V), in nats, and how many positions'
    argmax agree. `chunk` positions at a time go to fp32, so a large vocabulary never needs an fp32 copy of all."""
    p, q = p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])
    kl, agree = 0.0, 0
    for j in range(0, p.shape[0], chunk):
        lp = F.log_softmax(p[j:j + chunk].float(), -1)
        lq = F.log_softmax(q[j:j + chunk].float(), -1)
        kl += F.kl_div(lq, lp, log_target=True, reduction="sum").item()
        agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
    return kl, agree


@torch.no_grad()
def agreement(model, teacher, tokens: torch.Tensor, batch_size: int = 4, chunk: int = 1024,
              desc: str = "agreement") -> dict:
    """How closely `model` predicts like `teacher` on `tokens` (N, T): {"kl", "top1", "tokens"}.

    kl: mean forward KL(teacher || model) in nats over every position's next-token distribution; top1: fraction of
    positions whose argmax agrees. Logits stay in the models' dtype (`kl_sum` takes `chunk` positions at a time to
    fp32).
    """
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"agreement needs (num_seqs, seq_len) tokens, got shape {tuple(tokens.shape)}")
    device = next(model.parameters()).device
    modes = model.training, teacher.training
    model.eval()
    teacher.eval()
    kl, agree, count = 0.0, 0, 0
    for i in tqdm(range(0, tokens.shape[0], batch_size), desc=desc, leave=False):
        ids = tokens[i:i + batch_size].to(device)
        p = teacher(input_ids=ids, use_cache=False).logits  # (B, T, V)
        q = model(input_ids=ids, use_cache=False).logits
        if p.shape != q.shape:
            raise ValueError(f"teacher and model logits differ in shape ({tuple(p.shape)} vs {tuple(q.shape)}): "
                             "agreement needs the same vocabulary")
        batch_kl, batch_agree = kl_sum(p, q, chunk)
        kl, agree, count = kl + batch_kl, agree + batch_agree, count + p.shape[:-1].numel()
    model.train(modes[0])
    teacher.train(modes[1])
    return {"kl": kl / count, "top1": agree / count, "tokens": count}


def import_lm_eval():
    """lm-evaluation-harness is an optional dependency (the `eval` extra), imported only when tasks are asked for."""
    try:
        import lm_eval
        import lm_eval.models.huggingface  # noqa: F401
        import lm_eval.tasks  # noqa: F401
    except ImportError as e:
        raise ImportError(f'lm-eval tasks need lm-evaluation-harness ({e}); install it with: '
                          'pip install "taylor-calibrate[eval]"') from e
    return lm_eval


def lm_eval_tasks(model, tokenizer, tasks: list[str], include_path: str | None = None, limit: int | None = None,
                  batch_size: int = 4) -> dict:
    """Run lm-evaluation-harness tasks on the in-memory model: {task: {metric: value, ..., "samples": n}}.

    Metric names are lm-eval's own ("acc,none", "acc_norm,none", ...). Tasks are looked up in `include_path`
    (a directory of task YAML files) first and in lm-eval's built-in tasks only when some are not found there
    (indexing the ~15k built-in tasks takes seconds). Built-in tasks load their data sets from the Hugging Face
    hub, so offline they need a local task file (see tests/assets/tiny_mc.yaml).
    """
    lm_eval = import_lm_eval()
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks = list(tasks)
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(not manager.match_tasks([t]) for t in tasks):
        manager = TaskManager(include_path=include_path)
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        where = f"{include_path!r} or " if include_path else ""
        raise ValueError(f"lm-eval task(s) {missing} not found in {where}lm-eval's built-in tasks; pass a directory "
                         "of task YAML files with --lm_eval_include")
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, backend="causal")
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=False)
    n = out.get("n-samples", {})
    return {task: {**{k: float(v) if isinstance(v, (int, float)) else v for k, v in res.items()
                      if k not in ("alias", "name", "sample_len")},
                   "samples": n.get(task, {}).get("effective")}
            for task, res in out["results"].items()}


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def print_niah(scores: dict[str, dict]) -> None:
    """Accuracy table: one row per (task, model), one column per length ("-" where the length was skipped)."""
    first = next(iter(scores.values()))
    lengths = list(next(iter(first.values())))
    width = max(len(f"{task} ({who})") for who, s in scores.items() for task in s)
    print(f"  {'NIAH accuracy':<{width}}  " + "  ".join(f"{n:>6}" for n in lengths))
    for task in first:
        for who, s in scores.items():
            cells = ["     -" if s[task][n] is None else f"{s[task][n]:6.2f}" for n in lengths]
            print(f"  {f'{task} ({who})':<{width}}  " + "  ".join(cells))


def eval_out(args: EvalArgs) -> Path:
    """Where eval writes: --out, else <model>/eval, but only inside a hybrid of ours (a `convert` or `distill`
    output): any other model directory (a teacher, an export) is the user's, which eval does not write into unasked.
    A distill run's model/ is replaced whole when the run is resumed, so its report goes beside it (<run>/eval).
    A config.json that cannot be read here is left to the loader, which names it before anything is written."""
    if args.out:
        return Path(args.out)
    model = Path(args.model)
    if not model.is_dir():
        raise FileNotFoundError(f"--model {args.model} is not a directory; pass the output directory of `convert` or "
                                "`distill`'s <run>/model (the teacher goes to --teacher)")
    if model.name == "model" and is_output_of(model.parent, "distill"):
        return model.parent / "eval"
    try:
        config = read_json(model / "config.json", "") if (model / "config.json").is_file() else None
    except (OSError, ValueError):
        config = None
    if isinstance(config, dict) and config.get("model_type") != "taylor_hybrid":
        check_model_type(model, config, REWRITE)  # a damaged one is named as such, not as another model
        raise ValueError(f"--model {args.model} is not a hybrid of taylor-calibrate (its model_type is "
                         f"{config.get('model_type')!r}), so eval does not write its report inside it (<model>/eval "
                         "is the default only for `convert` and `distill` outputs); pass --out with a directory for "
                         "the report")
    return model / "eval"


@writes_out("eval", eval_out, nested_ok=("--model",))
def run_eval(args: EvalArgs) -> dict:
    """Held-out perplexity of a saved model (and optionally of its teacher on the same text); optionally
    long-context retrieval (--niah), agreement with the teacher (--agreement) and lm-eval tasks (--lm_eval_tasks)."""
    t0 = time.perf_counter()
    out = eval_out(args)
    if args.lm_eval_tasks:
        import_lm_eval()  # fail before the slow parts, not after them
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backend)
    apply_profile(args, device.type)
    model, tokenizer = load_model(args.model, device, dtype)
    if hasattr(model, "set_backend"):
        model.set_backend(backend)
    if tokenizer is None:
        raise FileNotFoundError(f"{args.model} has no tokenizer files; save one beside the model")
    check_context(args.data.seq_len, model.config, args.data.beyond_context, "model")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if args.niah and max_pos and all(n > max_pos for n in args.niah_lengths):  # else a table of "-" and exit 0
        try:  # the longest length there is: can it hold a prompt at all?
            check_lengths(tokenizer, args.niah_tasks, [max_pos], args.niah_new_tokens)
        except ValueError:
            raise ValueError(f"--niah true: this model's context (max_position_embeddings {max_pos}) cannot hold a "
                             "NIAH prompt (with this tokenizer its questions and needles alone take more); run eval "
                             "without --niah") from None
        raise ValueError(f"every --niah_lengths {args.niah_lengths} is beyond the model's context "
                         f"(max_position_embeddings {max_pos}); pass lengths up to it, e.g. --niah_lengths "
                         f"[{max_pos}]")
    times = {}
    t = time.perf_counter()
    splits = load_splits(args.data, tokenizer, args.data.seq_len, 1, args.data.eval_seqs)
    report = {"model": args.model, "model_ppl": perplexity(model, splits.heldout, args.eval_batch_size)["ppl"]}
    teacher = None
    if args.teacher:
        teacher = load_teacher(args.teacher, device, dtype)
        check_same_vocab(args.teacher, teacher.model, teacher.tokenizer, model, tokenizer,
                         getattr(model.config, "teacher_name", None) or "see its report.json")
        report["teacher"] = args.teacher
        report["teacher_ppl"] = perplexity(teacher.model, splits.heldout, args.eval_batch_size, "teacher ppl")["ppl"]
    check_finite_eval({f"{args.model}'s": report["model_ppl"],
                       f"the teacher {args.teacher}'s": report.get("teacher_ppl", 0.0)},
                      "no report was written; check the model's weights (convert it again if they are damaged)")
    times["ppl_s"] = time.perf_counter() - t
    if args.agreement:
        t = time.perf_counter()
        report["agreement"] = agreement(model, teacher.model, splits.heldout, args.eval_batch_size)
        times["agreement_s"] = time.perf_counter() - t
    if args.niah:  # both models read the same prompts: built from the model's tokenizer
        niah = dict(tasks=args.niah_tasks, lengths=args.niah_lengths, samples=args.niah_samples, seed=args.niah_seed,
                    batch_size=args.eval_batch_size, max_new_tokens=args.niah_new_tokens)
        t = time.perf_counter()
        answers = {"model": []}
        report["niah"] = niah_scores(model, tokenizer, **niah, desc="model niah", answers=answers["model"])
        times["niah_s"] = time.perf_counter() - t
        if teacher is not None:
            t = time.perf_counter()
            answers["teacher"] = []
            report["teacher_niah"] = niah_scores(teacher.model, tokenizer, **niah, desc="teacher niah",
                                                 answers=answers["teacher"])
            times["teacher_niah_s"] = time.perf_counter() - t
        for kind in REPLY_KINDS:
            report[f"niah_{kind}"] = {who: reply_rates(a, kind) for who, a in answers.items()}
        report["niah_by_distance"] = {who: reply_rates(a, "right", by="distance") for who, a in answers.items()}
        write_text(out / NIAH_ANSWERS, "".join(json.dumps({"model": who, **r}) + "\n"
                                              for who, a in answers.items() for r in a))
    if args.lm_eval_tasks:
        t = time.perf_counter()
        report["lm_eval"] = lm_eval_tasks(model, tokenizer, args.lm_eval_tasks, args.lm_eval_include,
                                          args.lm_eval_limit, args.eval_batch_size)
        times["lm_eval_s"] = time.perf_counter() - t
    report.update(eval_tokens=int(splits.heldout[:, 1:].numel()), backend=backend, stage_s=times,
                  wall_s=time.perf_counter() - t0)
    report = record(out / REPORT, report, args)

    rows = [(k, f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in report.items()
            if k in ("model", "model_ppl", "teacher", "teacher_ppl", "eval_tokens", "backend")]
    if "agreement" in report:
        a = report["agreement"]
        rows += [("KL(teacher || model), nats/token", f"{a['kl']:.4f}"), ("top-1 agreement", f"{a['top1']:.4f}")]
    for task, metrics in report.get("lm_eval", {}).items():
        rows += [(f"lm_eval {task} {k}", f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in metrics.items()]
    rows += [("stage seconds", ", ".join(f"{k[:-2]} {v:.0f}" for k, v in times.items())),
             ("wall time", f"{report['wall_s']:.1f} s"), ("output", str(out / REPORT))]
    print_table(rows)
    if "niah" in report:
        print(f"\n  ({args.niah_samples} samples per cell, greedy, answer in the {args.niah_new_tokens} tokens "
              f"generated)")
        print_niah({"model": report["niah"], **({"teacher": report["teacher_niah"]} if teacher is not None else {})})
    return report
