"""The `recovery` experiment: does a calibrated start recover with fewer distillation tokens (docs/method.md,
"Recovery distillation")?

For each policy and init (baseline `copy`, phase-2-only `align`, ours `taylor+align`, optionally the reference
`paper+align`), the same teacher, data, budget and schedule distil the hybrid; held-out loss is measured at fixed
token counts. Layer policies (uniform, bypass, greedy, layers=...) share one teacher pass (`ablate.build_all`); the
retrieval-scored ones (`heads`, `retrieval`, and `auto`, resolved as convert resolves it) are built by `convert`
itself, one student per init, all keeping the teacher's same retrieval heads. Tokens to matched recovery = N / N':
N = the budget, whose final held-out loss the baseline reaches; N' = the fewest tokens (linearly interpolated
between evaluations) at which the candidate reaches that loss.

All runs read the same token shards (the token cache's, or --data.source when it is a shard directory) in the same
order. NIAH retrieval is scored `niah_points` times along each run. Everything is resumable: built mixers and
students are cached (safetensors), each run has its own directory with distill's atomic checkpoints and its NIAH
records, and finished runs are kept, so a killed experiment continues where it stopped; `--time_limit_s` stops it
cleanly, so a long experiment runs as a series of time-limited jobs of one command (with the options the first call
recorded in options.json: `check_same_experiment`). Under `torchrun --nproc_per_node K` every run trains
data-parallel (DDP) over the K processes: the first process converts, tokenises and scores NIAH, the others read its
caches.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from taylor_calibrate.experiments.ablate import TeacherPass, build_all, check_policies, parse_init
from taylor_calibrate.checks import writes_out
from taylor_calibrate.config import (ConvertArgs, RecoveryArgs, apply_profile, apply_train_profile,
                                     convert_args_of)
from taylor_calibrate.convert import convert, resolve_runtime
from taylor_calibrate.data import TokenSplits, distill_data, is_token_dir, read_token_meta
from taylor_calibrate.distill import Dist, all_sum, distill, identity_diff, init_distributed
from taylor_calibrate.evaluate import perplexity
from taylor_calibrate.model.loading import parse_json, read_json, read_text
from taylor_calibrate.results import record, write_json
from taylor_calibrate.model.hybrid import convert_teacher, make_mixers
from taylor_calibrate.ops import resolve_backend, training_backend
from taylor_calibrate.policy import RETRIEVAL, gdn_layers
from taylor_calibrate.retrieval import check_lengths, niah_scores
from taylor_calibrate.teacher import load_teacher, load_tokenizer, resolve_device, resolve_dtype
from taylor_calibrate.training import autocast

log = logging.getLogger("taylor_calibrate")

CONVERTED = ("auto", *RETRIEVAL)
"""Policies whose students `convert` builds (the retrieval-scored ones; "auto" resolves as convert resolves it)."""


def tokens_to_reach(tokens: list[float], losses: list[float], target: float) -> float | None:
    """Fewest tokens at which the curve reaches `target`, linear between evaluations; None if it never does."""
    for i, (n, l) in enumerate(zip(tokens, losses)):
        if l <= target:
            if i == 0:
                return float(n)
            n0, l0 = tokens[i - 1], losses[i - 1]
            return n0 + (n - n0) * (l0 - target) / (l0 - l)
    return None


def tokens_to_match(baseline: dict, candidate: dict) -> float | None:
    """N / N' (module docstring): > 1 when the candidate needs fewer tokens; None when it never reaches the
    baseline's final loss within the budget; inf when it starts there."""
    n = baseline["tokens"][-1]
    n_prime = tokens_to_reach(candidate["tokens"], candidate["heldout_loss"], baseline["heldout_loss"][-1])
    if n_prime is None:
        return None
    return math.inf if n_prime == 0 else n / n_prime


def parse_runs(args: RecoveryArgs) -> list[tuple[str, str]]:
    runs = [(p, i) for p in args.policies for i in args.inits]
    for item in args.extra:
        policy, sep, init = item.partition(":")
        if not sep:
            raise ValueError(f"bad extra run {item!r}: use <policy>:<init>, e.g. uniform:paper+align")
        if (policy, init) not in runs:
            runs.append((policy, init))
    check_policies([p for p, _ in runs if p not in CONVERTED])
    for _, init in runs:
        parse_init(init)
    return runs


def _save_mixers(mixers: dict, path: Path) -> None:
    """Mixers' state as one safetensors file ("<layer>.<name>" keys), written atomically."""
    tmp = path.with_suffix(".tmp")
    save_file({f"{i}.{n}": t.detach().contiguous() for i, m in mixers.items() for n, t in m.state_dict().items()},
              str(tmp))
    tmp.replace(path)


def _cached_mixers(model, args, path: Path):
    """Mixers saved in `path` (the layers it holds): copy-only modules, then the saved state."""
    state = load_file(str(path), device=str(next(model.parameters()).device))
    layers = sorted({int(k.split(".", 1)[0]) for k in state})
    mixers = make_mixers(model, layers, args.gdn, args.seed)
    for i, m in mixers.items():
        m.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.split(".", 1)[0] == str(i)})
    return mixers


def build_or_load(model, splits, specs, policies, args, backend, device, cache: Path):
    """(built, alignment reports, kept, scores) as `ablate.build_all` gives them, from the cache of a previous
    (killed) run when it wrote one: mixers as safetensors, kept layers as JSON."""
    keys = list(dict.fromkeys(specs + [("taylor", False)]))
    files = {k: cache / f"{k[0]}{'+align' if k[1] else ''}.safetensors" for k in keys}
    layers_file = cache / "layers.json"
    if layers_file.exists() and all(f.exists() for f in files.values()):
        saved = read_json(layers_file, f"delete {cache} and run again (it is rebuilt)")
        if set(saved["kept"]) >= set(policies):
            log.info("recovery: mixers and kept layers from %s", cache)
            return {k: _cached_mixers(model, args, f) for k, f in files.items()}, {}, saved["kept"], saved["scores"]
    every = list(range(model.config.num_hidden_layers))
    tp = TeacherPass.run(model, splits.calib, every, device, args.eval_batch_size,
                         store_far=args.phase2.far_weight > 0)
    built, reports, kept, scores = build_all(tp, specs, args, backend, policies, splits.calib)
    cache.mkdir(parents=True, exist_ok=True)
    for k, f in files.items():
        _save_mixers(built[k], f)
    write_json(layers_file, {"kept": kept, "scores": scores})
    return built, reports, kept, scores


STUDENT_KEYS = ("policy", "policy_auto", "kept_layers", "gdn_layers", "headwise_kept_groups", "kv_fraction",
                "policy_scores", "teacher_ppl", "hybrid_ppl", "retrieval")
"""What a student's cache records of its convert report (recovery.json's `students`)."""


def convert_args(args: RecoveryArgs, policy: str, init: str) -> ConvertArgs:
    """The `convert` options of one run: recovery's shared ones with the run's policy and init (`parse_init`: copy =
    init copy without phase 2; align = copy + phase 2). From token shards, convert reads the corpus they were
    written from (tokens.json)."""
    method, aligned = parse_init(init)
    conv = convert_args_of(args, policy=policy, init=method, align=aligned)
    if is_token_dir(args.data.source):
        meta = read_token_meta(Path(args.data.source).expanduser())
        conv.data = dataclasses.replace(conv.data, **{k: meta[k] for k in ("source", "text_field", "split",
                                                                           "heldout_fraction")})
    return conv


def build_or_load_students(teacher, runs: list[tuple[str, str]], args: RecoveryArgs, cache: Path,
                           finished: frozenset = frozenset(), build=None, students: dict | None = None) -> dict:
    """{policy: {init: what convert kept}} for the runs of CONVERTED policies: each student built once by
    `convert` and cached (its GDN mixers as safetensors, then its report's STUDENT_KEYS as JSON, written
    last), so a restarted experiment loads it instead of converting again. A `finished` run needs only the JSON (its
    weights are not read again), so an experiment's small files carried to a fresh machine continue it there. Of the
    uncached students only those of the runs in `build` (default: every run) are converted: recovery converts each
    just before its run trains, so a call that the time limit stops converts no student it does not train. Added to
    `students` when given. All inits of one policy must keep the same heads (they are scored on the teacher):
    checked."""
    students = {} if students is None else students
    for policy, init in runs:
        if policy not in CONVERTED or init in students.get(policy, {}):
            continue
        weights, meta = student_file(cache, policy, init), cache / f"{policy}__{init}.json"
        if meta.exists() and (weights.exists() or (policy, init) in finished):
            log.info("recovery: student %s / %s from %s", policy, init, weights if weights.exists() else meta)
            info = read_json(meta, f"delete {cache} and run again (it is rebuilt)")
        elif build is not None and (policy, init) not in build:
            continue
        else:
            print(f"\nrecovery: converting the {policy} / {init} student")
            conv = convert_args(args, policy, init)
            c = convert(conv, teacher, resolve_runtime(conv))
            report, hybrid = c.report, c.hybrid
            cache.mkdir(parents=True, exist_ok=True)
            tmp = weights.with_suffix(".tmp")  # every token mixer: GDN ones and the kept attention phase 2 re-aligned
            save_file({k: v.detach().contiguous() for k, v in hybrid.state_dict().items() if ".self_attn." in k},
                      str(tmp))
            tmp.replace(weights)
            info = {k: report[k] for k in STUDENT_KEYS}
            write_json(meta, info)
            del hybrid
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        students.setdefault(policy, {})[init] = info
        first_init, first = next(iter(students[policy].items()))
        same = ("policy", "gdn_layers", "headwise_kept_groups")
        if any(info[k] != first[k] for k in same):
            raise RuntimeError(f"policy {policy}: the {init} student keeps other attention heads than the {first_init} "
                               f"one ({ {k: info[k] for k in same} } vs { {k: first[k] for k in same} }); they are "
                               f"scored on the teacher and must agree: delete {cache} and run again")
    return students


def student_file(cache: Path, policy: str, init: str) -> Path:
    return cache / f"{policy}__{init}.mixers.safetensors"


def load_student(model, args: RecoveryArgs, info: dict, path: Path):
    """A cached student (build_or_load_students): the teacher, head-wise as convert built it, with its saved token
    mixers (GDN and kept attention)."""
    groups = {int(i): g for i, g in info["headwise_kept_groups"].items()}
    hybrid = convert_teacher(model, info["gdn_layers"], args.gdn, teacher_name=args.teacher, seed=args.seed,
                             kept_groups=groups)
    state = load_file(str(path), device=str(next(model.parameters()).device))
    missing, unexpected = hybrid.load_state_dict(state, strict=False)
    bad = unexpected + [k for k in missing if ".self_attn." in k]
    if bad:
        raise RuntimeError(f"{path} does not fit the student it was saved for ({bad[:3]}): delete it and run again")
    return hybrid


def _eager():
    """Layers that distill compiled (`--train.compile`, on CUDA) run eagerly: generation's ever-new shapes would
    recompile them (minutes) and spend dynamo's recompile limit, past which training's own graphs run eager."""
    stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return stance("force_eager") if stance else contextlib.nullcontext()


def _niah(model, tokenizer, args, device, desc):
    if not args.niah:
        return None
    with _eager(), autocast(device):
        return niah_scores(model, tokenizer, tasks=args.niah_tasks, lengths=args.niah_lengths,
                           samples=args.niah_samples, seed=args.niah_seed, batch_size=args.niah_samples,
                           max_new_tokens=args.niah_new_tokens, desc=desc)


def niah_steps(steps: int, points: int) -> list[int]:
    """`points` optimizer steps from 0 to `steps`, evenly spaced (both ends included)."""
    return sorted({round(k * steps / (points - 1)) for k in range(points)})


def _read_jsonl(path: Path) -> list[dict]:
    fix = f"delete {path} (it is written again) or pass a new --out"
    return [parse_json(l, f"{path}:{i + 1}", fix) for i, l in enumerate(read_text(path, fix).splitlines())
            if l.strip()] if path.exists() else []


def plot_curves(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(result["policies"])
    niah = any(isinstance(r, dict) and r.get("niah_curve") for rs in result["policies"].values() for r in rs.values())
    fig, axes = plt.subplots(1 + niah, len(policies), figsize=(5 * len(policies), 4 * (1 + niah)), squeeze=False)
    styles = ("-", "--", ":", "-.")  # one colour per init (as in the loss panel), one line style per length
    for ax, policy in zip(axes[1] if niah else [], policies):
        for color, (init, run) in enumerate(result["policies"][policy].items()):
            if isinstance(run, dict) and run.get("niah_curve"):
                for n, ls in zip(result["niah_lengths"], styles * len(result["niah_lengths"])):
                    ax.plot([r["tokens"] / 1e6 for r in run["niah_curve"]],
                            [_mean_at(r["scores"], n) for r in run["niah_curve"]], marker="o", ms=3, ls=ls,
                            color=f"C{color}", label=f"{init}, {n // 1024}K" if n >= 1024 else f"{init}, {n}")
        ax.set_title(f"{policy}: NIAH (mean of {', '.join(result.get('niah_tasks') or ['tasks'])})")
        ax.set_xlabel("distillation tokens (M)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        if ax.lines:  # a policy none of whose runs has finished yet has nothing to label
            ax.legend(fontsize=7)
    for ax, policy in zip(axes[0], policies):  # the loss above the teacher's, log scale: inits far apart stay readable
        for color, (init, run) in enumerate(result["policies"][policy].items()):
            if isinstance(run, dict) and "tokens" in run:
                gap = [max(loss - result["teacher_loss"], 1e-4) for loss in run["heldout_loss"]]
                ax.plot([t / 1e6 for t in run["tokens"]], gap, marker="o", ms=3, color=f"C{color}", label=init)
        kv = (result.get("kv_fraction") or {}).get(policy)
        ax.set_title(f"{policy} ({len(result['kept'][policy])} attention layers kept)" if kv is None
                     else f"{policy} ({kv:.0%} of the KV cache kept)")
        ax.set_xlabel("distillation tokens (M)")
        ax.set_ylabel(f"held-out loss - teacher's {result['teacher_loss']:.3f} (nats/token)")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(result: dict) -> str:
    kv = result.get("kv_fraction")
    kept = (", ".join(f"{p} {f:.1%}" for p, f in kv.items()) + " of the KV cache kept" if kv
            else f"{result['kept_fraction']:.0%} of layers kept")
    lines = [f"Teacher `{result['teacher']}`: held-out loss {result['teacher_loss']:.4f}; budget "
             f"{result['budget_tokens']:,} tokens per run; {kept}.", "",
             "| policy | init | loss at 0 | final loss | tokens to match (copy / this) |", "|---|---|---|---|---|"]
    for policy, runs in result["policies"].items():
        for init, run in runs.items():
            if not isinstance(run, dict):
                continue
            ratio = tokens_to_match(runs["copy"], run) if "copy" in runs and init != "copy" else None
            r = "-" if init == "copy" else ("not reached" if ratio is None else f"{ratio:.2f}x")
            lines.append(f"| {policy} | {init} | {run['heldout_loss'][0]:.4f} | {run['heldout_loss'][-1]:.4f} | {r} |")
    if any(r.get("niah") for runs in result["policies"].values() for r in runs.values() if isinstance(r, dict)):
        lines += ["", "NIAH accuracy (mean over tasks) at start -> end, by context length:", "",
                  "| policy | init | " + " | ".join(str(n) for n in result["niah_lengths"]) + " |",
                  "|---|---|" + "---|" * len(result["niah_lengths"])]
        lines.append("| - | teacher | " + " | ".join(f"{_mean_at(result['teacher_niah'], n):.2f}"
                                                       for n in result["niah_lengths"]) + " |")
        for policy, runs in result["policies"].items():
            for init, run in runs.items():
                if isinstance(run, dict) and run.get("niah"):
                    lines.append(f"| {policy} | {init} | " + " | ".join(
                        f"{_mean_at(run['niah']['start'], n):.2f} -> {_mean_at(run['niah']['end'], n):.2f}"
                        for n in result["niah_lengths"]) + " |")
    curves = [(p, i, r) for p, rs in result["policies"].items() for i, r in rs.items()
              if isinstance(r, dict) and len(r.get("niah_curve") or []) > 2]
    if curves:
        lines += ["", "NIAH accuracy along each run (mean over tasks; one column per context length):", "",
                  "| policy | init | tokens | " + " | ".join(str(n) for n in result["niah_lengths"]) + " |",
                  "|---|---|---|" + "---|" * len(result["niah_lengths"])]
        for policy, init, run in curves:
            for rec in run["niah_curve"]:
                lines.append(f"| {policy} | {init} | {rec['tokens']:,} | "
                             + " | ".join(f"{_mean_at(rec['scores'], n):.2f}" for n in result["niah_lengths"]) + " |")
    if result.get("complete") is False:
        lines += ["", "Incomplete: runs still to finish (rerun the command to continue)."]
    if result.get("throughput_tokens_per_s"):
        lines += ["", f"Distillation throughput {result['throughput_tokens_per_s']:,.0f} tokens/s"
                  + (f", MFU {result['mfu']:.1%}" if result.get("mfu") else "")]
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def _mean_at(scores: dict | None, n: int) -> float:
    vals = [v[str(n)] for v in (scores or {}).values() if v.get(str(n)) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


@contextlib.contextmanager
def _main_first(ctx: Dist):
    """The first process runs the block first (it builds and caches), then the others run it (they read the caches)."""
    if not ctx.main:
        dist.barrier()
    yield
    if ctx.main and ctx.world > 1:
        dist.barrier()


@dataclasses.dataclass
class Students:
    """Every policy's hybrids before training: layer-wise mixers (`built`, by init) or saved head-wise students."""
    built: dict
    align_reports: dict
    students: dict
    kept: dict
    scores: dict
    kv_fraction: dict
    kept_groups: dict


def run_dir_of(out: Path, policy: str, init: str) -> Path:
    return out / "runs" / f"{policy}__{init}"


def prepare_students(teacher, splits, runs: list[tuple[str, str]], args: RecoveryArgs, backend: str, device,
                     ctx: Dist, out: Path) -> Students:
    """Build (or load from `out`) what the runs start from: mixers for layer-wise policies; for head-wise ones the
    cached students (a finished run's from its JSON alone) and, for a policy with none, its first run's, whose kept
    heads the summary reports (the rest are converted as their runs come up: `student_for`). The main process
    first, the others then read its files."""
    n = teacher.model.config.num_hidden_layers
    layer_runs = [(p, i) for p, i in runs if p not in CONVERTED]
    built, align_reports, kept, scores = {}, {}, {}, {}
    with _main_first(ctx):
        if layer_runs:
            specs = list(dict.fromkeys(parse_init(i) for _, i in layer_runs))
            built, align_reports, kept, scores = build_or_load(teacher.model, splits, specs,
                                                               list(dict.fromkeys(p for p, _ in layer_runs)), args,
                                                               backend, device, out / "mixers")
        finished = frozenset(r for r in runs if (run_dir_of(out, *r) / "result.json").exists())
        students = build_or_load_students(teacher, runs, args, out / "students", finished, build=())
        first: dict[str, tuple[str, str]] = {}
        for r in runs:
            first.setdefault(r[0], r)
        need = {r for p, r in first.items() if p in CONVERTED and p not in students}  # kept heads, for the summary
        students = build_or_load_students(teacher, runs, args, out / "students", finished, build=need,
                                          students=students)
    kv_fraction = {p: len(k) / n for p, k in kept.items()}
    kept_groups = {}
    for policy, by_init in students.items():
        info = next(iter(by_init.values()))
        kept[policy], scores[policy] = info["kept_layers"], info["policy_scores"]
        kv_fraction[policy], kept_groups[policy] = info["kv_fraction"], info["headwise_kept_groups"]
    return Students(built, align_reports, students, kept, scores, kv_fraction, kept_groups)


def student_for(teacher, policy: str, init: str, st: Students, args: RecoveryArgs, ctx: Dist, out: Path) -> None:
    """Convert (or load) the run's student into `st` just before it trains, when it starts from one."""
    if policy in CONVERTED and init not in st.students.get(policy, {}):
        with _main_first(ctx):
            build_or_load_students(teacher, [(policy, init)], args, out / "students", students=st.students)


def starting_hybrid(model, policy: str, init: str, st: Students, args: RecoveryArgs, out: Path):
    """(the run's hybrid in fp32, its converted layers)."""
    if policy in st.students:
        info = st.students[policy][init]
        return load_student(model, args, info, student_file(out / "students", policy, init)).float(), info["gdn_layers"]
    converted = gdn_layers(st.kept[policy], model.config.num_hidden_layers)
    hybrid = convert_teacher(model, converted, args.gdn, teacher_name=args.teacher, mixers=st.built[parse_init(init)])
    return hybrid.float(), converted


def run_result(rep: dict, converted: list[int], niah_file: Path, niah: bool) -> dict:
    """A finished run's result.json: its held-out curve, speed and NIAH along the run."""
    curve = sorted({r["step"]: r for r in _read_jsonl(niah_file)}.values(), key=lambda r: r["step"])
    return {"tokens": rep["eval_tokens"], "heldout_loss": rep["heldout_loss"], "heldout_kl": rep["heldout_kl"],
            "tokens_per_s": rep["tokens_per_s"], "mfu": rep["mfu"], "processes": rep["processes"],
            "gdn_layers": converted,
            "niah": {"start": curve[0]["scores"], "end": curve[-1]["scores"]} if niah else None,
            "niah_curve": [{"tokens": r["tokens"], "scores": r["scores"]} for r in curve] if niah else None}


def summary(results: dict, st: Students, speeds: list, policies: list[str], **fields) -> dict:
    """recovery.json's content from the runs finished so far: tokens-to-match per policy, the students, mean speed."""
    for rs in results.values():
        if "copy" in rs and "taylor+align" in rs:
            rs["tokens_to_match"] = tokens_to_match(rs["copy"], rs["taylor+align"])
        if "align" in rs and "taylor+align" in rs:
            rs["tokens_to_match_phase2only"] = tokens_to_match(rs["align"], rs["taylor+align"])
    tps, mfus = [s for s, _ in speeds if s], [m for _, m in speeds if m]
    return {
        **fields, "kept_fraction": st.kv_fraction[policies[0]], "kv_fraction": st.kv_fraction, "kept": st.kept,
        "kept_groups": st.kept_groups, "policy_scores": st.scores, "policies": results,
        "students": {p: {i: {k: v for k, v in info.items() if k != "policy_scores"} for i, info in by_init.items()}
                     for p, by_init in st.students.items()},
        "throughput_tokens_per_s": sum(tps) / len(tps) if tps else None,
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "align": {m: {k: v for k, v in r.items() if k != "layers"} for m, r in st.align_reports.items()},
    }


OPTIONS = "options.json"
FREE_OPTIONS = ("out", "overwrite", "time_limit_s", "command", "device", "backend", "eval_batch_size")  # may change


def check_same_experiment(out: Path, args: RecoveryArgs) -> None:
    """One experiment per --out: its runs, mixers and students are reused by name, so a call with other options
    (other than FREE_OPTIONS, e.g. the time limit of a series of jobs) would mix settings in one recovery.json.
    The first call records the resolved options; a later one with others is refused naming what differs."""
    mine = json.loads(json.dumps({k: v for k, v in dataclasses.asdict(args).items() if k not in FREE_OPTIONS},
                                 default=str))
    path = out / OPTIONS
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        write_json(path, mine)
        return
    diffs = identity_diff(read_json(path, "delete it to record this call's options, or pass a new --out"), mine)
    if diffs:
        raise ValueError(f"{out} holds a recovery experiment run with other options ({'; '.join(diffs)}): its runs "
                         "would mix them; pass those options again to continue it, or a new --out")


@writes_out("recovery")
def run_recovery(args: RecoveryArgs) -> dict:
    """Distil every policy x init on the same data and budget; curves, tokens-to-match table, NIAH along each run."""
    t0 = time.perf_counter()
    deadline = None if args.time_limit_s is None else time.monotonic() + args.time_limit_s
    runs = parse_runs(args)
    device = resolve_device(args.device)
    ctx, device = init_distributed(device)
    if ctx.world > 1 and args.train.parallel != "ddp":
        raise ValueError(f"recovery under torchrun trains with DDP; --train.parallel {args.train.parallel} is not "
                         "supported here (NIAH along the runs generates on one process); use `distill` for FSDP")
    if ctx.world > 1:
        dist.barrier()  # every process has checked --out before the first one writes there
    say = print if ctx.main else (lambda *a, **k: None)
    dtype = resolve_dtype(args.dtype, device)
    backend = resolve_backend(args.backend)
    profile = apply_profile(args, device.type)
    apply_train_profile(args.train, profile)
    train_backend = training_backend(backend, args.backend, True)
    out = Path(args.out)
    tokenizer = load_tokenizer(args.teacher) if args.niah else None
    if args.niah:
        check_lengths(tokenizer, args.niah_tasks, args.niah_lengths, args.niah_new_tokens)
    if ctx.main:
        check_same_experiment(out, args)
    teacher = load_teacher(args.teacher, device, dtype, tokenizer=tokenizer)
    model, tokenizer = teacher.model, teacher.tokenizer
    d = args.data
    train_rows, heldout = distill_data(d, tokenizer, args.train.tokens, main=ctx.main,
                                       barrier=dist.barrier if ctx.world > 1 else None)
    splits = TokenSplits(calib=train_rows.first(d.calib_seqs), heldout=heldout)  # calibration: the first windows
    policies = list(dict.fromkeys(p for p, _ in runs))
    st = prepare_students(teacher, splits, runs, args, backend, device, ctx, out)

    teacher_loss = perplexity(model, splits.heldout, args.eval_batch_size, "teacher loss")["nll"]
    teacher_niah_file = out / "teacher_niah.json"
    with _main_first(ctx):
        if args.niah and not teacher_niah_file.exists():
            write_json(teacher_niah_file, _niah(model, tokenizer, args, device, "teacher niah"))
    teacher_niah = read_json(teacher_niah_file, "delete it (it is measured again)") if args.niah else None

    results: dict[str, dict] = {p: {} for p in policies}
    speeds = []
    complete = True
    worked = False  # has this call advanced a run yet

    def summarize() -> dict:
        """recovery.json / .md / curves from the runs finished so far (rewritten after each run)."""
        result = summary(results, st, speeds, policies, teacher=args.teacher, teacher_loss=teacher_loss,
                         budget_tokens=args.train.tokens, teacher_niah=teacher_niah, niah_lengths=args.niah_lengths,
                         niah_tasks=args.niah_tasks, tokens_dir=str(train_rows.root), train_windows=len(train_rows),
                         complete=complete, profile=profile, backend=backend, train_backend=train_backend,
                         device=str(device), wall_s=time.perf_counter() - t0)
        result = record(out / "recovery.json", result, args)
        (out / "recovery.md").write_text(markdown(result))
        plot_curves(result, out / "recovery_curves.png")
        return result

    for policy, init in runs:
        run_dir = run_dir_of(out, policy, init)
        done = run_dir / "result.json"
        if done.exists():
            results[policy][init] = read_json(done, "delete it to train that run again, or pass a new --out")
            speeds.append((results[policy][init]["tokens_per_s"], results[policy][init]["mfu"]))
            continue
        late = deadline is not None and all_sum([time.monotonic() > deadline], ctx, device)[0] > 0  # all agree
        if late and worked:  # each call advances one run at least
            complete = False
            break
        worked = True
        student_for(teacher, policy, init, st, args, ctx, out)
        hybrid, converted = starting_hybrid(model, policy, init, st, args, out)
        hybrid.set_backend(train_backend)
        run_dir.mkdir(parents=True, exist_ok=True)
        niah_file = run_dir / "niah.jsonl"
        tokens_per_step = args.train.batch_size * d.seq_len
        at = set(niah_steps(max(1, math.ceil(args.train.tokens / tokens_per_step)), args.niah_points))

        def score_niah(step, m, niah_file=niah_file, at=at, tag=f"{policy}/{init}"):
            if not (ctx.main and args.niah and step in at) or any(r["step"] == step for r in _read_jsonl(niah_file)):
                return
            rec = {"step": step, "tokens": step * tokens_per_step,
                   "scores": _niah(m, tokenizer, args, device, f"{tag} niah at step {step}")}
            with niah_file.open("a") as f:
                f.write(json.dumps(rec) + "\n")

        say(f"\nrecovery: {policy} / {init}: {len(converted)} GDN layers ({st.kv_fraction[policy]:.1%} of the KV "
            f"cache kept), {args.train.tokens:,} tokens")
        rep = distill(hybrid, model, train_rows, splits.heldout, args.train, run_dir,
                      eval_batch_size=args.eval_batch_size, ctx=ctx, desc=f"{policy}/{init}", on_step=score_niah,
                      teacher_spec=args.teacher, deadline=deadline,
                      start_over=f"delete {run_dir} to run {policy} / {init} again from its start (the other runs "
                                 "are kept), or pass a new --out")
        if rep.get("stopped_at") is not None:
            complete = False
            say(f"recovery: {policy} / {init} stopped at step {rep['stopped_at']} of {rep['steps']} (time limit); "
                "run the same command again to continue")
            break
        if ctx.main:  # the others wait at the barrier below, so the next run starts from what it wrote
            res = run_result(rep, converted, niah_file, args.niah)
            write_json(done, res)
            results[policy][init] = res
            speeds.append((res["tokens_per_s"], res["mfu"]))
            summarize()
            first, last = res["heldout_loss"][0], res["heldout_loss"][-1]
            print(f"recovery: {policy} / {init}: held-out loss {first:.4f} -> {last:.4f} at "
                  f"{rep['tokens_per_s'] or 0:,.0f} tokens/s")
        if ctx.world > 1:
            dist.barrier()
        del hybrid
        if device.type == "cuda":
            torch.cuda.empty_cache()

    result = summarize() if ctx.main else {}
    if result:
        print("\n" + markdown(result))
    if ctx.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return result
