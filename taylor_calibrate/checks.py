"""Checks that run before any work: where a command may write, and whether its sizes fit the model.

A run that fails after an hour because `--out` is a file, or that overwrites the teacher it reads, costs the user
their time or their files; these checks move such failures to the first second and name the flag and the fix.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import socket
import tempfile
import time
from pathlib import Path

from taylor_calibrate.config import TOKEN_CACHE_ENV, token_cache_dir
from taylor_calibrate.model.loading import parse_json, read_json
from taylor_calibrate.results import OUTPUTS, file_in_the_way, found, is_output_of, marks, strays

log = logging.getLogger("taylor_calibrate")

_REPLACES_OUT = ("convert", "tokenize")  # write --out whole in a staged sibling; the other commands write into it
_CORPUS_KEYWORDS = ("builtin", "pysrc")  # --data.source values that name no path


def _local(spec: str | None) -> Path | None:
    """The resolved local file or directory an input spec names, or None for hub ids, corpus keywords, nothing."""
    if not spec or spec in _CORPUS_KEYWORDS or spec.startswith("hf:"):
        return None
    p = Path(spec).expanduser()
    return p.resolve() if p.exists() else None


def _check_inputs(path: Path, out: str, inputs: dict[str, str | None], nested_ok: tuple[str, ...], flag: str) -> None:
    """`path` (resolved --out) may not be an input, hold one, or (a directory input not in `nested_ok`) lie inside
    one: the command would replace or write into what it reads."""
    for name, spec in inputs.items():
        src = _local(spec)
        if src is None:
            continue
        if path == src or path in src.parents:
            what = "is" if path == src else "holds"
        elif src.is_dir() and src in path.parents and name not in nested_ok:
            what = "lies inside"
        else:
            continue
        kind = "directory" if src.is_dir() else "file"
        raise ValueError(f"{flag} {out} {what} the {name} {kind} {spec}: writing there would replace or change what "
                         f"the command reads; pass another {flag} (outside it)")


_CACHE_COMMANDS = ("tokenize", "distill", "recovery", "tradeoff")  # the commands that write into the token cache


def check_token_cache(option: str | None, inputs: dict[str, str | None]) -> None:
    """The token cache (`--data.token_cache`, else $TAYLOR_CALIBRATE_TOKEN_CACHE, else ~/.cache/...) may not be, or
    lie inside, an input directory: its entries and locks would be written into what the command reads (a corpus
    whose files then change under it, a teacher's directory). Nor may it be, or lie under, a file."""
    cache = token_cache_dir(option).expanduser().resolve()
    where = (f"--data.token_cache {option}" if option else f"${TOKEN_CACHE_ENV}={os.environ[TOKEN_CACHE_ENV]}"
             if os.environ.get(TOKEN_CACHE_ENV) else f"the token cache {cache}")
    if existing := file_in_the_way(cache):  # else "[Errno 20] Not a directory: .../.locks" once the run needs it
        what = "is a file" if existing == cache else f"lies under {existing}, which is a file"
        raise NotADirectoryError(f"{where} {what}; pass --data.token_cache with a directory")
    for name, spec in inputs.items():
        src = _local(spec)
        if src is None or not (cache == src or (src.is_dir() and src in cache.parents)):
            continue
        what = "is" if cache == src else "lies inside"
        raise ValueError(f"{where} {what} the {name} {'directory' if src.is_dir() else 'file'} {spec}: its token "
                         "shards and locks would be written into what the command reads; pass --data.token_cache "
                         "with a directory outside it")


def check_out(out: str, command: str, *, overwrite: bool | None = False, inputs: dict[str, str | None] | None = None,
              flag: str = "--out", nested_ok: tuple[str, ...] = (), lock: contextlib.ExitStack | None = None) -> Path:
    """Fail now, not after the run, when `out` cannot take `command`'s output: it is a file or lies under one (or is a
    dangling link), it is not writable, it is, holds or lies inside one of the `inputs` ({"--teacher": spec, ...};
    inside is allowed for the names in `nested_ok`), or it is a non-empty directory that is not an earlier output of
    `command` and `overwrite` is off (None: the command has no --overwrite). With `lock`, the lock of `out`
    (`output_lock`) is taken into it before the last check, so a second run names the first instead. Returns the
    resolved path."""
    if not str(out).strip():  # Path("") is the working directory, which would then be checked and written
        raise ValueError(f"{flag} is empty; pass a directory path")
    raw = Path(out).expanduser()
    if raw.is_symlink() and not raw.exists():
        try:
            os.stat(raw)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FileNotFoundError(f"{flag} {out} is a link that leads back to itself (through "
                                        f"{os.readlink(raw)}); pass a directory path") from None
        raise FileNotFoundError(f"{flag} {out} is a link to {os.readlink(raw)}, which does not exist; pass a directory "
                                "path (or create the link's target)")
    path = raw.resolve()
    room = _name_max(path) - len(f".{path.name}.partial-{2 ** 22}")  # the staged sibling's name, the longest written
    if len(path.name.encode()) > room:
        raise ValueError(f"{flag} {out}: its last component is {len(path.name.encode())} bytes, and the command "
                         f"writes siblings named .<it>.partial-<pid> and .<it>.lock beside it, so it may have at most "
                         f"{room}; pass a shorter name")
    here = Path.cwd().resolve()
    if path == here or path in here.parents:
        what = "the working directory" if path == here else f"a parent of the working directory {here}"
        raise ValueError(f"{flag} {out} is {what}: the command's files would land among everything there; pass a new "
                         f"directory (e.g. {flag} out/run)")
    _check_inputs(path, out, inputs or {}, nested_ok, flag)
    if blocked := file_in_the_way(path):
        where = "is an existing file" if blocked == path else f"lies under {blocked}, which is a file"
        raise NotADirectoryError(f"{flag} {out} {where}; pass a directory path")
    existing = next(p for p in (path, *path.parents) if p.exists())
    beside = next((p for p in path.parents if p.exists()), existing)  # the lock and staged outputs go here
    for where in dict.fromkeys([existing, beside]):
        try:
            fd, probe = tempfile.mkstemp(dir=where, prefix=".taylor-calibrate-write-test-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            role = "" if where == existing else f", where the run keeps its lock and stages its output beside {path}"
            raise PermissionError(f"{flag} {out}: cannot write in {where} ({e.strerror or e}){role}; pass a writable "
                                  f"location (or make {where} writable)") from None
    if lock is not None:
        lock.enter_context(output_lock(path, command, flag))
    if path.is_dir() and any(path.iterdir()):
        if command in _REPLACES_OUT:
            _check_replaced_out(path, out, command, flag, overwrite)
        elif not is_output_of(path, command):
            _check_foreign_out(path, out, command, overwrite, flag)
    return path


def _name_max(path: Path) -> int:
    """The longest file name the file system under `path` takes (255 on the common ones)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _named(entries: list, n: int = 4) -> str:
    return ", ".join(map(str, entries[:n])) + (f" and {len(entries) - n} more" if len(entries) > n else "")


def _odd(path: Path, command: str) -> str:
    """Why a file that would mark `path` as `command`'s output does not: it is no regular file."""
    odd = [f.relative_to(path) for n, _ in marks(command) for f in found(path, n) if not f.is_file()]
    return f"; its {odd[0]} is not a regular file: a directory, pipe, socket or device" if odd else ""


def _check_replaced_out(path: Path, out: str, command: str, flag: str, overwrite: bool | None) -> None:
    """A command that replaces --out whole (`convert`, `tokenize`) deletes what the directory held: it may do so only
    to an earlier output of its own holding nothing it did not write, whatever --overwrite says."""
    if not is_output_of(path, command):
        there = sorted(p.name for p in path.iterdir())
        raise FileExistsError(f"{flag} {out} is a non-empty directory that is not an earlier `{command}` output (it "
                              f"holds {_named(there)}{_odd(path, command)}); `{command}` replaces its {flag} whole, so "
                              f"it takes only a new or empty directory or an earlier `{command}` output"
                              f"{'' if overwrite is None else ', whatever --overwrite says'}; pass a new or empty "
                              "directory")
    if extra := strays(path, command):
        raise FileExistsError(f"{flag} {out} is an earlier `{command}` output that also holds {_named(extra)}, which "
                              f"`{command}` did not write and replacing the directory would delete; move "
                              f"{'it' if len(extra) == 1 else 'them'} away or pass another {flag}")
    if overwrite is False:  # the earlier model is the user's result: replaced only when they say so
        raise FileExistsError(f"{flag} {out} holds an earlier `{command}` output; pass --overwrite true to replace it "
                              f"(it is replaced only once the new one is complete), or another {flag}")


def _check_foreign_out(path: Path, out: str, command: str, overwrite: bool | None, flag: str) -> None:
    """A non-empty --out that is not an earlier output of `command` needs --overwrite; and even with it, a command
    that writes into --out (not replacing it whole) may not write among another command's output (the directory would
    hold parts of two runs: a distill report beside the convert's model, read back as one), nor over a file or folder
    of the user's with a name it writes (`OUTPUTS`: a report.json, a damage.md, a model/ of theirs)."""
    if not overwrite:
        fix = "(it is never overwritten)" if overwrite is None else "or --overwrite true to write into it anyway"
        why = f" ({_odd(path, command).removeprefix('; ')})" if _odd(path, command) else ""
        raise FileExistsError(f"{flag} {out} is a non-empty directory that is not an earlier `{command}` output{why}; "
                              f"pass a new or empty directory {fix}")
    other = next((c for c in OUTPUTS if c != command and is_output_of(path, c)), None)
    if other:
        raise FileExistsError(f"{flag} {out} holds an earlier `{other}` output, and `{command}` would write its files "
                              f"among them (--overwrite true does not empty it), leaving parts of two runs in one "
                              f"directory; pass another {flag}, or delete {out} first")
    theirs = next((f for name, _ in OUTPUTS[command] for f in found(path, name)), None)
    if theirs:
        rel = theirs.relative_to(path)
        raise FileExistsError(f"{flag} {out} holds a {rel} that is not an earlier `{command}` output's, which "
                              f"`{command}` would replace (--overwrite true writes among the directory's files, never "
                              f"over one of them); pass another {flag} (or move {rel} away)")


# --- one writer per output ---------------------------------------------------------------------------------------
_HELD: dict[Path, list] = {}  # lock file -> [open file, depth]: a process may take its own lock again


def lock_file(path: Path) -> Path:
    """Where the lock of output `path` lives: a hidden sibling, so that it survives the output being replaced."""
    return path.parent / f".{path.name}.lock"


def _holder(f) -> dict:
    """The lock file's record of who holds it ({} when unreadable; a lock file is a few bytes: 64 KiB at most is
    read)."""
    try:
        f.seek(0)
        return parse_json(f.read(1 << 16) or "{}", f.name, "")
    except (ValueError, OSError):
        return {}


def _alive_here(holder: dict) -> bool:
    """Whether the recorded holder may still run: a live pid on this host, or any pid on another host."""
    if holder.get("host") != socket.gethostname():
        return bool(holder.get("pid"))
    try:
        os.kill(int(holder["pid"]), 0)
    except (ProcessLookupError, ValueError, KeyError, TypeError):
        return False
    except PermissionError:
        pass
    return True


@contextlib.contextmanager
def output_lock(path: str | Path, command: str = "", flag: str = "--out"):
    """Hold the exclusive lock of output `path` (a directory or file a command writes) while the block runs.

    The lock is an flock on `lock_file(path)`, which records the holder (pid, host, command, start time): the OS
    drops it when the holder exits or is killed, so a lock left by a dead run is taken over; a held one is refused
    naming its holder. On file systems without flock, the recorded pid decides (dead on this host: stale). Under
    torchrun only rank 0 locks. Re-entrant within a process."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    path = Path(path).expanduser().resolve()
    lf = lock_file(path)
    if lf in _HELD:
        _HELD[lf][1] += 1
        try:
            yield
        finally:
            _HELD[lf][1] -= 1
        return
    import fcntl

    made = [p for p in [path.parent, *path.parent.parents] if not p.exists()]  # removed again if left empty
    path.parent.mkdir(parents=True, exist_ok=True)
    if lf.exists() and not lf.is_file():  # never made by a run of ours; a pipe would block the holder's reader
        raise ValueError(f"the lock file {lf} of {flag} {path} is not a regular file (a directory, pipe, socket or "
                         f"device); remove it (runs of taylor-calibrate only make regular ones) or pass another {flag}")
    while True:
        f = open(lf, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            held = e.errno in (errno.EAGAIN, errno.EACCES) or _alive_here(_holder(f))
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS) or held:
                who = _holder(f)
                f.close()
                if not held:
                    raise
                desc = (f"`{who.get('command') or 'a command'}`, pid {who.get('pid', '?')} on {who.get('host', '?')}, "
                        f"since {who.get('started', '?')}") if who else "a process that is starting"
                raise BlockingIOError(f"{flag} {path} is being written by another run ({desc}); wait for it to end or "
                                      f"pass another {flag} (the lock is {lf})") from None
        try:  # the file may have been removed (and made anew) by its previous holder between open and flock
            same = os.fstat(f.fileno()).st_ino == os.stat(lf).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    try:
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                            "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        f.flush()
    except OSError as e:  # a full disk: no lock file left behind
        with contextlib.suppress(OSError):
            lf.unlink()
        with contextlib.suppress(OSError):
            f.close()
        raise OSError(f"could not write the lock file {lf} of {flag} {path} ({e.strerror or e}); free space or fix "
                      f"the permissions there, or pass another {flag}") from None
    _HELD[lf] = [f, 0]
    try:
        yield
    finally:
        del _HELD[lf]
        with contextlib.suppress(OSError):
            lf.unlink()
        f.close()
        for d in made:  # deepest first; a run that wrote its output leaves them non-empty
            with contextlib.suppress(OSError):
                d.rmdir()


def writes_out(command: str, out_of=lambda args: args.out, nested_ok: tuple[str, ...] = ()):
    """Decorator of a command's run_* function: before it runs, check its --out against its inputs (--teacher,
    --student, --model, --data.source: `check_out`) and take the lock of --out, held until it returns or raises; a
    run that fails removes the --out it created if it left it empty."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(args):
            inputs = {f"--{k}": getattr(args, k, None) for k in ("teacher", "student", "model")}
            data = getattr(args, "data", None)
            inputs["--data.source"] = getattr(data, "source", None)
            if command in _CACHE_COMMANDS and data is not None:
                check_token_cache(getattr(data, "token_cache", None), inputs)
            with contextlib.ExitStack() as stack:
                path = check_out(str(out_of(args)), command, overwrite=getattr(args, "overwrite", None),
                                 inputs=inputs, nested_ok=nested_ok, lock=stack)
                existed = path.exists()
                try:
                    return fn(args)
                except BaseException:
                    if not existed:  # a failed run leaves no empty --out behind (rmdir takes only an empty one)
                        with contextlib.suppress(OSError):
                            path.rmdir()
                    raise
        return run
    return wrap


def check_same_vocab(teacher_spec: str, teacher_model, teacher_tokenizer, model, tokenizer, origin: str,
                     who: str = "model") -> None:
    """A teacher compared with a model token by token (KL, agreement, perplexity on the same ids) must share its
    vocabulary: the same size and the same token at every id."""
    sizes = teacher_model.config.get_text_config().vocab_size, model.config.get_text_config().vocab_size
    if sizes[0] != sizes[1] or teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        why = f"vocab_size {sizes[0]} vs {sizes[1]}" if sizes[0] != sizes[1] else "other tokens at the same ids"
        if _local(teacher_spec) is not None and _local(teacher_spec) == _local(origin):  # the right teacher
            raise ValueError(f"the {who}'s tokenizer files do not match its teacher {teacher_spec!r}, which it was "
                             f"converted from ({why}): they were replaced since; copy them again from the teacher")
        raise ValueError(f"teacher {teacher_spec!r} does not share the {who}'s vocabulary ({why}), so their token ids "
                         f"cannot be compared; pass the teacher it was converted from ({origin})")


def check_teacher_origin(student: str, recorded: str | None, teacher: str | None) -> str:
    """The teacher `distill` trains `student` toward, checked against the one it was converted from (config.json's
    teacher_name, and report.json's teacher_hash of its weights): a --teacher that is another model is allowed (a
    bigger model of the same vocabulary, say) with a warning; without --teacher, a recorded teacher whose weights
    changed since the conversion is refused, since the user asked for the original. Returns the teacher spec."""
    from taylor_calibrate.teacher import teacher_config_hash, teacher_hash, teacher_ref

    spec = teacher or recorded
    if not spec:
        raise ValueError(f"{student} does not record its teacher; pass --teacher")
    if not recorded:
        return spec
    if teacher is None and recorded.startswith("/") and not os.path.exists(recorded):  # recorded absolute: a path
        raise FileNotFoundError(f"the teacher {recorded} that {student} records does not exist any more (moved or "
                                "deleted); pass --teacher with where it is now")
    try:
        report = Path(student) / "report.json"
        rep = read_json(report, "") if report.is_file() else {}
    except (OSError, ValueError):
        rep = {}  # no report (a distilled model/ directory) or a damaged one, which the loader has refused
    then, then_config = rep.get("teacher_hash"), rep.get("teacher_config_hash")
    now = teacher_hash(spec) if then else None
    now_config = teacher_config_hash(spec) if then_config else None
    same_place = teacher_ref(spec) == teacher_ref(recorded)
    if then and now:
        same = then == now and not (then_config and now_config and then_config != now_config)
    else:  # a hub id or an older conversion without the hash: where it is is all there is to compare
        same = same_place
    if same:
        return spec
    changed = "weights" if then != now else "config.json"
    if teacher is None:
        what = (f"its weights changed since (teacher_hash {then} then, {now} now)" if changed == "weights" else
                "its config.json changed since (teacher_config_hash differs)")
        raise ValueError(f"the teacher {recorded} that {student} records is no longer the model it was converted "
                         f"from: {what}; restore it, or pass --teacher {recorded} to distil toward it as it is now")
    log.warning("--teacher %s is not the teacher %s was converted from (%s%s): distilling toward another model",
                teacher, student, recorded, f", whose {changed} changed since" if same_place else "")
    return spec


def check_same_layers(teacher_spec: str, teacher_config, student_config, hidden_weight: float) -> None:
    """--train.hidden_weight compares every layer's output with the teacher's: both need as many layers, as wide
    (zip would silently pair the first layers of a deeper teacher)."""
    t, s = teacher_config.get_text_config(), student_config
    if hidden_weight and (t.num_hidden_layers, t.hidden_size) != (s.num_hidden_layers, s.hidden_size):
        raise ValueError(f"--train.hidden_weight compares each layer's output with the teacher's, but teacher "
                         f"{teacher_spec!r} has {t.num_hidden_layers} layers of width {t.hidden_size} and the student "
                         f"{s.num_hidden_layers} of width {s.hidden_size}; pass the teacher it was converted from, or "
                         "--train.hidden_weight 0")


def check_context(seq_len: int, config, allow: bool, who: str) -> None:
    """--data.seq_len must fit the model's context (max_position_embeddings) unless explicitly allowed."""
    ctx = getattr(config, "max_position_embeddings", None)
    if ctx and seq_len > ctx and not allow:
        raise ValueError(f"--data.seq_len {seq_len} is longer than the {who}'s context (max_position_embeddings "
                         f"{ctx}); lower --data.seq_len or pass --data.beyond_context true to run past it anyway")
