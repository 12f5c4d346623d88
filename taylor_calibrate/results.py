"""Results files: every subcommand and benchmark writes its results JSON through `record`, which adds where the
figures came from (commit, dirty flag, resolved arguments, command line, environment); `render` turns such a file
into markdown (`taylor-calibrate report FILE.json`), so no hand-kept markdown twin can drift from it."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from taylor_calibrate.model.loading import parse_json

PACKAGE_ROOT = Path(__file__).resolve().parent
PROVENANCE_KEYS = ("commit", "dirty", "command", "args", "env")
_PROVENANCE_TYPES = {"commit": str, "dirty": bool, "command": str, "args": dict, "env": dict}  # as `record` writes


def git_state(repo: str | Path = PACKAGE_ROOT) -> tuple[str | None, bool | None]:
    """(HEAD commit, whether tracked files differ from it) of the git work tree holding `repo`; (None, None) outside
    git. Untracked files (outputs, caches) do not count as dirty."""
    def git(*cmd):
        return subprocess.run(["git", "-C", str(repo), *cmd], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None, None
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):  # no git binary, or it hung
        return None, None
    return head.stdout.strip(), (bool(status.stdout.strip()) if status.returncode == 0 else None)


@functools.cache
def package_state() -> tuple[str | None, bool | None]:
    """The package's git state, read once per process (first asked at the start of a command, by `record` at the
    latest): the code that runs, even when the tree moves on before a long run writes its results."""
    return git_state()


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment() -> dict:
    """Library versions and the accelerator; no host name or user name."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": _version("transformers"),
            "fla": _version("flash-linear-attention", "fla-core"), "triton": _version("triton"), "gpu": gpu,
            "cuda": torch.version.cuda, "platform": f"{platform.system()}-{platform.machine()}"}


def resolved_args(args) -> dict | None:
    """A stage's argument dataclass, a benchmark's argparse namespace, or a dict -> a plain dict."""
    if args is None:
        return None
    if dataclasses.is_dataclass(args):
        return dataclasses.asdict(args)
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    return dict(args)


def command_line(argv: list[str] | None = None) -> str:
    """This process's command line as a user would type it (`python -m pkg ...`, `python script.py ...`)."""
    argv = list(sys.argv if argv is None else argv)
    prog = Path(argv[0]) if argv else Path("python")
    if prog.name == "__main__.py":
        head = ["python", "-m", prog.parent.name]
    elif prog.suffix == ".py":
        head = ["python", argv[0]]
    else:
        head = [prog.name]
    return shlex.join(head + argv[1:])


def record(path: str | Path, result: dict, args=None, command: str | None = None, repo: str | Path = PACKAGE_ROOT) -> dict:
    """Write `result` to `path` as JSON with its provenance, atomically (a temporary file renamed into place: a
    killed run leaves the old file or the new one, never half of one). `args` are the fully resolved arguments
    (after profiles filled them); `command` defaults to `args.command` or this process's command line."""
    same = Path(repo).resolve() == PACKAGE_ROOT
    commit, dirty = package_state() if same else git_state(repo)
    if command is None:
        command = getattr(args, "command", None) or command_line()
    out = {**result, "commit": commit, "dirty": dirty, "command": command, "args": resolved_args(args),
           "env": environment()}
    write_json(path, out)
    return out


def file_in_the_way(path: Path) -> Path | None:
    """The file that is `path`, or lies above it, where a directory must be (None: nothing is in the way)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    return None if existing.is_dir() else existing


def write_text(path: str | Path, text: str) -> None:
    """Atomic write: a temporary file beside `path`, renamed into place; a failed write removes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes it 0600; the file is as readable as any other the user writes
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def umask() -> int:
    """This process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_json(path: str | Path, obj: dict) -> None:
    """Atomic JSON write; results go through `record`, this serves bookkeeping (checkpoint pointers, resume caches)."""
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(v, default=str) + "`"
    return str(v).replace("|", "\\|")


def _table(rows: list[dict]) -> list[str]:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return lines


def render(result: dict, title: str = "Results") -> str:
    """Markdown view of a results JSON: its provenance, then scalars as one table, lists of records as tables and
    anything else as JSON."""
    env = result.get("env") or {}
    commit = result.get("commit")
    dirty = result.get("dirty")
    lines = [f"# {title}", "",
             f"- commit: `{commit or 'unknown'}`, tree "
             + {True: "dirty (uncommitted changes)", False: "clean"}.get(dirty, "state not recorded"),
             f"- command: `{result.get('command') or 'not recorded'}`",
             "- environment: " + (", ".join(f"{k} {v}" for k, v in env.items() if v) or "not recorded")]
    if result.get("provenance"):
        lines.append(f"- provenance: {result['provenance']}")
    scalars = {k: v for k, v in result.items()
               if k not in PROVENANCE_KEYS and k != "provenance" and not isinstance(v, (dict, list))}
    if scalars:
        lines += ["", "| key | value |", "|---|---|"] + [f"| {k} | {_cell(v)} |" for k, v in scalars.items()]
    for k, v in result.items():
        if k in PROVENANCE_KEYS or not isinstance(v, (dict, list)):
            continue
        lines += ["", f"## {k}", ""]
        if isinstance(v, list) and not any(isinstance(r, (dict, list)) for r in v):
            lines.append(_cell(v))
        elif isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            lines += _table(v)
        elif isinstance(v, dict) and v and all(isinstance(r, dict) for r in v.values()):
            lines += _table([{"": name, **r} for name, r in v.items()])
        else:
            lines += ["```json", json.dumps(v, indent=2, default=str), "```"]
    if result.get("args"):
        lines += ["", "## args", "", "```json", json.dumps(result["args"], indent=2, default=str), "```"]
    return "\n".join(lines) + "\n"


@dataclass
class ReportArgs:
    """Render a results JSON as markdown."""

    file: str
    """A results JSON (report.json, ablation.json, recovery.json or a benchmark's output)."""
    out: str | None = None
    """Write the markdown here instead of printing it; an existing file is not overwritten."""


def run_report(args: ReportArgs) -> str:
    """Print (or write) the markdown view of a results JSON."""
    from taylor_calibrate.model.loading import read_json

    path = Path(args.file)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a results JSON written by a subcommand or benchmark")
    result = read_json(path, "pass a results JSON file")  # a pipe would block the reader
    wrong = [f"{k} is a {type(result[k]).__name__}" for k, kind in _PROVENANCE_TYPES.items()
             if result.get(k) is not None and not isinstance(result[k], kind)]
    if wrong:
        raise ValueError(f"{path} is not a results file as `record` writes it ({'; '.join(wrong)}): it is damaged; "
                         "run the command that wrote it again")
    if missing := [k for k in ("commit", "dirty") if k not in result]:  # what every results file records
        raise ValueError(f"{path} is not a results file as `record` writes it (no {', '.join(missing)}); pass a results "
                         "JSON written by a subcommand or benchmark")
    try:
        text = render(result, title=path.stem)
    except RecursionError:  # a results file is a few levels deep
        raise ValueError(f"{path} nests JSON deeper than Python's recursion limit: it is not a results file; pass a "
                         "results JSON") from None
    if args.out is None:
        print(text, end="")
        return text
    out = Path(args.out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass another --out or remove it first")
    if blocked := file_in_the_way(out.parent):
        raise NotADirectoryError(f"--out {out} lies under {blocked}, which is a file; pass a path in a directory")
    write_text(out, text)
    return text


# --- outputs: what each command writes, and how an earlier output of it is recognised ------------------------------
# What each command writes under --out (globs), with the keys that show a file there is its own: the JSON object (for
# .jsonl: its first line) it writes holds them. The entries with keys are its marks: a directory holding one is an
# earlier output of the command, written into (resumed, rewritten) freely; a file of that name with other content is
# the user's. The entries without keys (tables, plots, weights, run directories) cannot tell: in a directory that is
# not an earlier output, every existing path the command writes is the user's and is never replaced, --overwrite or
# not (`checks._check_foreign_out`). A non-empty --out that is no earlier output needs --overwrite.
_METRICS = ("step", "heldout_loss")  # the first line of a distill run's metrics.jsonl (its step-0 evaluation)
_LATEST = ("step", "dir")  # checkpoints/latest.json
_ANSWERS = ("task", "length", "answer", "right")  # a NIAH answer record (retrieval.niah_scores)
OUTPUTS = {
    "convert": [("report.json", ("hybrid_ppl", "layer_types"))],
    "eval": [("report.json", ("model", "model_ppl")), ("niah_answers.jsonl", ("model", *_ANSWERS))],
    "distill": [("metrics.jsonl", _METRICS), ("checkpoints/latest.json", _LATEST),
                ("report.json", ("heldout_kl", "tokens_per_step")),  # written last: model/ is complete (`finished`)
                ("model", None), ("checkpoints/step_*", None), ("checkpoints/.step_*", None)],
    "ablate": [("ablation.json", ("rows", "teacher_ppl", "kept")), ("ablation.md", None)],
    "recovery": [("recovery.json", ("teacher_loss", "policies")), ("options.json", ("policies", "inits", "train")),
                 ("mixers/layers.json", ("kept", "scores")),
                 ("students/*.json", ("gdn_layers", "kv_fraction")), ("runs/*/metrics.jsonl", _METRICS),
                 ("runs/*/checkpoints/latest.json", _LATEST), ("recovery.md", None), ("recovery_curves.png", None),
                 ("teacher_niah.json", None), ("mixers/*.safetensors", None), ("students/*__*", None),
                 ("runs/*__*", None)],  # students and runs are named <policy>__<init>
    "tradeoff": [("tradeoff.json", ("rows", "teacher_name", "niah_tasks")), ("answers/*.jsonl", _ANSWERS),
                 ("tradeoff.md", None), ("tradeoff.png", None), ("e2e_*", None)],  # e2e_*: distill runs
    "damage": [("damage.json", ("rows", "layer_types", "teacher_probes")), ("damage.md", None)],
    "tokenize": [("tokens.json", ("tokens", "tokenizer", "dtype"))],
    "export": [],  # never written into a non-empty directory
}
_MARK_BYTES = 1 << 22  # the most read of a file to tell whether it is ours: our marks are far smaller (KBs)


# What a command that replaces its --out whole wrote there, so that a replace deletes only that: `convert` lists its
# files in its report.json ("files"); a token-shard directory holds these.
WROTE = "files"
_TOKEN_FILES = ("tokens.json", "calib.bin", "heldout.bin")
_LEGACY_CONVERT = (".json", ".safetensors", ".jinja", ".model")  # convert outputs from before the list: a model's files


def strays(path: Path, command: str) -> list[str]:
    """The entries of `path` (an earlier output of `command`, which replaces its --out whole) that the command did not
    write, top-level names first-level only ("notes.txt", ".git"): replacing the directory would delete them."""
    listed = None
    if command == "tokenize":
        listed = set(_TOKEN_FILES)
    elif command == "convert":
        try:
            listed = set(json.loads((path / "report.json").read_text())[WROTE]) | {"report.json"}
        except (OSError, ValueError, KeyError, TypeError):
            listed = None
    out = set()
    for p in Path(path).rglob("*"):
        rel = p.relative_to(path).as_posix()
        if p.is_dir() and not p.is_symlink():
            if not any(p.iterdir()):
                out.add(rel.split("/")[0])
            continue
        ours = (rel in listed) if listed is not None else (
            "/" not in rel and p.is_file() and not p.is_symlink() and (p.suffix in _LEGACY_CONVERT or rel == "merges.txt"))
        if not ours:
            out.add(rel.split("/")[0])
    return sorted(out)


def found(path: Path, pattern: str) -> list[Path]:
    """What glob `pattern` names under `path`, dangling links included (pathlib skips them for a plain name)."""
    if any(c in pattern for c in "*?["):
        return sorted(path.glob(pattern))
    return [path / pattern] if os.path.lexists(path / pattern) else []


def written_by(f: Path, keys: tuple[str, ...]) -> bool:
    """Whether file `f` holds what a command writes there: a JSON object (for .jsonl, its first line) with `keys`.
    At most _MARK_BYTES are read: a larger file (or first line) is not ours."""
    if not f.is_file():  # a pipe would block the reader, a directory is no file of ours
        return False
    try:
        with open(f, "rb") as fh:
            head = fh.readline(_MARK_BYTES + 1) if f.suffix == ".jsonl" else fh.read(_MARK_BYTES + 1)
        if len(head) > _MARK_BYTES:
            return False
        data = parse_json(head, f, "")
    except (ValueError, OSError):
        return False
    return all(k in data for k in keys)


def marks(command: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(name, keys) for name, keys in OUTPUTS[command] if keys]


def is_output_of(path: Path, command: str) -> bool:
    """Whether directory `path` holds an earlier output of `command`, by the content of the files it writes."""
    return any(written_by(f, keys) for name, keys in marks(command) for f in found(Path(path), name))


def finished(out: Path) -> bool:
    """Whether distill output `out` holds the report.json a run writes last, which marks its model/ complete: a run
    stopped before it, or resumed since (which removes it first), has none."""
    return written_by(Path(out) / "report.json", dict(marks("distill"))["report.json"])


