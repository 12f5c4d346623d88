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
    from taylor_calibrate.model.loading import read_text

    path = Path(args.file)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; pass a results JSON written by a subcommand or benchmark")
    try:
        result = json.loads(read_text(path, "pass a results JSON file"))  # a pipe would block the reader
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e}); pass a results JSON") from e
    if not isinstance(result, dict):
        raise ValueError(f"{path} holds a JSON {type(result).__name__}, not a results object")
    wrong = [f"{k} is a {type(result[k]).__name__}" for k, kind in _PROVENANCE_TYPES.items()
             if result.get(k) is not None and not isinstance(result[k], kind)]
    if wrong:
        raise ValueError(f"{path} is not a results file as `record` writes it ({'; '.join(wrong)}): it is damaged; "
                         "run the command that wrote it again")
    text = render(result, title=path.stem)
    if args.out is None:
        print(text, end="")
        return text
    out = Path(args.out)
    if out.exists():
        raise FileExistsError(f"{out} exists; pass another --out or remove it first")
    write_text(out, text)
    return text
