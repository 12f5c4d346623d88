"""Checks that run before any work: where a command may write, and whether its sizes fit the model.

A run that fails after an hour because `--out` is a file, or that overwrites the teacher it reads, costs the user
their time or their files; these checks move such failures to the first second and name the flag and the fix.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# How an earlier output of each command is recognised: a file it writes (with a key of its own when several
# commands write a file of that name). A non-empty --out that is none of these needs --overwrite.
_OUTPUT_MARKS = {
    "convert": [("report.json", "hybrid_ppl")],
    "eval": [("report.json", "model_ppl")],
    "distill": [("metrics.jsonl", None), ("checkpoints", None), ("tokens", None), ("report.json", "heldout_kl")],
    "ablate": [("ablation.json", None)],
    "recovery": [("recovery.json", None), ("runs", None), ("mixers", None)],
    "tradeoff": [("tradeoff.json", None)],
    "export": [],  # never written into a non-empty directory
}


def is_output_of(path: Path, command: str) -> bool:
    """Whether directory `path` holds an earlier output of `command`."""
    for name, key in _OUTPUT_MARKS[command]:
        f = path / name
        if not f.exists():
            continue
        if key is None:
            return True
        try:
            if key in json.loads(f.read_text()):
                return True
        except (ValueError, OSError):
            pass
    return False


def _local(spec: str | None) -> Path | None:
    """The local directory an input spec lives in (a .gguf file: its folder), or None for hub ids / nothing."""
    if not spec:
        return None
    p = Path(spec).expanduser()
    if p.is_file():
        p = p.parent
    return p.resolve() if p.is_dir() else None


def check_out(out: str, command: str, *, overwrite: bool = False, inputs: dict[str, str | None] | None = None,
              flag: str = "--out") -> Path:
    """Fail now, not after the run, when `out` cannot take `command`'s output: it is a file or lies under one, it is
    not writable, it is (or holds) one of the `inputs` ({"--teacher": spec, ...}), or it is a non-empty directory
    that is not an earlier output of `command` and `overwrite` is off. Returns the resolved path."""
    path = Path(out).expanduser().resolve()
    for name, spec in (inputs or {}).items():
        src = _local(spec)
        if src is not None and (path == src or path in src.parents):
            what = "is" if path == src else "holds"
            raise ValueError(f"{flag} {out} {what} the {name} directory {spec}: writing there would replace what "
                             f"the command reads; pass another {flag}")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        where = "is an existing file" if existing == path else f"lies under {existing}, which is a file"
        raise NotADirectoryError(f"{flag} {out} {where}; pass a directory path")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".taylor-calibrate-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(f"{flag} {out}: cannot write in {existing} ({e.strerror or e}); pass a writable "
                              "location") from None
    if path.is_dir() and any(path.iterdir()) and not overwrite and not is_output_of(path, command):
        raise FileExistsError(f"{flag} {out} is a non-empty directory that is not an earlier `{command}` output; "
                              f"pass a new or empty directory, or --overwrite true to replace its contents")
    return path


def check_context(seq_len: int, config, allow: bool, who: str) -> None:
    """--data.seq_len must fit the model's context (max_position_embeddings) unless explicitly allowed."""
    ctx = getattr(config, "max_position_embeddings", None)
    if ctx and seq_len > ctx and not allow:
        raise ValueError(f"--data.seq_len {seq_len} is longer than the {who}'s context (max_position_embeddings "
                         f"{ctx}); lower --data.seq_len or pass --data.beyond_context true to run past it anyway")
