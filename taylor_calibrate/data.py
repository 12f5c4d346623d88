"""Corpora for calibration and evaluation: load documents, split them, pack them into token rows.

Everything here is offline and deterministic, with no seed to pass:

    docs = load_documents(spec)                          # [(doc_id, text)], in source order
    calib_docs, heldout_docs = split_documents(docs, spec.heldout_fraction)
    calib = pack_tokens(calib_docs, tokenizer, seq_len, num_seqs)   # (num_seqs, seq_len) int64

`load_splits` does the three steps. The calibration tokens (teacher statistics, per-layer
alignment) and the held-out tokens (perplexity) come from disjoint *documents*: a document
lands on one side by a sha1 of its id, so it stays on that side whatever else is in the corpus.

The default corpus ("builtin") is the Python standard library's own source. It is always
there and needs no download, but it is *code*: perplexities measured on it are code
perplexities, not comparable with WikiText numbers, and the exact file set (hence the
numbers) depends on the Python version that runs the toolkit.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from taylor_calibrate.checkpoint import waiting_lock
from taylor_calibrate.checks import writes_out
from taylor_calibrate.config import TOKEN_CACHE_ENV, CorpusSpec, token_cache_dir
from taylor_calibrate.model.loading import tokenizer_fingerprint
from taylor_calibrate.results import is_output_of, umask

log = logging.getLogger(__name__)

# Directories of the standard library that are not ordinary library source: tests are full of
# deliberately odd code, idlelib is an application, config-* and _sysconfigdata* describe the build.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk
_PYSRC_MAX_BYTES = 1_000_000  # pysrc skips larger files: generated tables, not code
_PYSRC_SUFFIXES = {".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh"}
_CHUNK_CHARS = 2000  # a single text file is cut into documents of about this many characters


@dataclass
class TokenSplits:
    calib: torch.Tensor  # (calib_seqs, seq_len) int64, from calibration documents only
    heldout: torch.Tensor  # (heldout_seqs, seq_len) int64, from held-out documents only


# ----------------------------------------------------------------------------- loading


def load_documents(spec: CorpusSpec) -> list[tuple[str, str]]:
    """Read every document of `spec.source` as (doc_id, text), in a deterministic order.

    doc_id is a path relative to the source (files), "<file>:<line>" (chunks of one text file),
    or a record index (.jsonl, datasets). Ids are what the split is keyed on, so they must not
    depend on where the corpus happens to live on disk.
    """
    source = spec.source
    if source == "builtin":
        docs = _stdlib_documents()
    elif source == "pysrc":
        docs = _pysrc_documents()
    elif source.startswith("hf:"):
        docs = _hub_documents(source[3:], spec)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"corpus source {source!r} does not exist; pass 'builtin', 'pysrc', a text file, a directory, "
                "a .jsonl file, a datasets save_to_disk directory, or 'hf:<name>'"
            )
        check_readable(path, source)
        if not (path.is_dir() or path.is_file()):
            raise ValueError(f"corpus source {source!r} is not a regular file or directory (a pipe, socket or device "
                             "cannot be read twice, as the split and the tokenizer need); save the text to a file and "
                             "pass that")
        if is_token_dir(source):
            raise ValueError(f"{source!r} holds token shards (`tokenize`), not documents: `distill` and `recovery` "
                             "read them; other commands need the corpus itself")
        if path.is_dir() and any((path / m).exists() for m in _DATASET_MARKERS):
            docs = _saved_dataset_documents(path, spec)
        elif path.is_dir():
            docs = _directory_documents(path, spec.text_field)
        elif path.suffix.lower() == ".jsonl":
            docs = _jsonl_documents(path, spec.text_field)
        else:
            text = _read_text(path)
            if text is None:
                raise ValueError(f"corpus file {source!r} is binary or not UTF-8 text")
            docs = _chunk_text(path.name, text)
    if not any(text.strip() for _, text in docs):
        raise ValueError(f"corpus {source!r} is empty: it holds no non-blank text")
    return docs


def _read_text(path: Path) -> str | None:
    """The file's text, or None for binaries (a NUL byte) and files that are not UTF-8."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _stdlib_files() -> list[tuple[str, Path]]:
    """(doc id, path) of every file "builtin" reads, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        if any(d in _STDLIB_SKIP_DIRS or d.startswith("config-") for d in dirs):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        files.append((rel.as_posix(), path))
    return files


def _stdlib_documents() -> list[tuple[str, str]]:
    return [(doc_id, text) for doc_id, path in _stdlib_files() if (text := _read_text(path)) is not None]


def _site_files() -> list[tuple[str, Path]]:
    """(path relative to its site-packages directory, path) of every source file "pysrc" may read beyond builtin's, in
    reading order: each site-packages directory in sysconfig / site order, sorted within; __pycache__ and files over
    _PYSRC_MAX_BYTES (generated tables) left out. A path may appear under two directories (the first readable wins)."""
    import site

    roots = []
    for r in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()):
        if Path(r).is_dir() and Path(r).resolve() not in {x.resolve() for x in roots}:
            roots.append(Path(r))
    files = []
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.suffix in _PYSRC_SUFFIXES and p.is_file()):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" not in rel and path.stat().st_size <= _PYSRC_MAX_BYTES:
                files.append((rel, path))
    return files


def _pysrc_documents() -> list[tuple[str, str]]:
    """builtin's documents (with builtin's ids, so at the same heldout_fraction each lands on the same side as in
    builtin: training on pysrc never reads builtin's held-out text) and every source file of the installed packages
    ("site/<path>": Python, stubs and the C / C++ / CUDA sources and headers they ship, `_site_files`; a path seen
    twice is kept once). The file set is that of the environment that runs the toolkit."""
    docs, seen = _stdlib_documents(), set()
    for rel, path in _site_files():
        if rel in seen:
            continue
        text = _read_text(path)
        if text is not None:
            seen.add(rel)
            docs.append((f"site/{rel}", text))
    return docs


def _directory_documents(root: Path, field: str = "text") -> list[tuple[str, str]]:
    """Every text file under root, recursively, sorted (a .jsonl file: its records' `field`); hidden files/dirs (.git)
    and binaries skipped."""
    docs, skipped = [], 0
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        if path.suffix.lower() == ".jsonl":  # records, as a .jsonl source file is read (not its JSON syntax as text)
            docs += [(f"{rel.as_posix()}:{name}", text) for name, text in _jsonl_documents(path, field)]
            continue
        text = _read_text(path)
        if text is None:
            skipped += 1
            continue
        docs.append((rel.as_posix(), text))
    if skipped:
        log.info("corpus %s: skipped %d binary or non-UTF-8 files", root, skipped)
    if not docs:
        if shards := [f"{side}.bin" for side in SIDES if (root / f"{side}.bin").is_file()]:  # tokens.json gone
            raise ValueError(f"corpus directory {str(root)!r} holds token shards ({', '.join(shards)}) but no "
                             "tokens.json, which says what they hold: they are incomplete; run `tokenize` again into a "
                             "new directory, or pass the corpus's text")
        raise ValueError(f"corpus directory {str(root)!r} holds no text files")
    return docs


def _chunk_text(name: str, text: str) -> list[tuple[str, str]]:
    """Cut one text file into documents at blank lines, each about _CHUNK_CHARS long.

    A single file would otherwise be a single document, and a corpus of one document cannot be
    split into calibration and held-out parts. Chunks end at blank lines (paragraph or function
    boundaries), and are named by their first line so the split of a chunk is stable.
    """
    docs, lines, chars, start = [], [], 0, 1
    for i, line in enumerate(text.splitlines(keepends=True), start=1):
        if not lines:
            start = i
        lines.append(line)
        chars += len(line)
        if not line.strip() and chars >= _CHUNK_CHARS:
            docs.append((f"{name}:{start}", "".join(lines)))
            lines, chars = [], 0
    if lines:
        docs.append((f"{name}:{start}", "".join(lines)))
    return docs


def _jsonl_documents(path: Path, field: str) -> list[tuple[str, str]]:
    data = path.read_bytes()
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"corpus file {path} is not UTF-8 (line {line}: {e.reason}); re-encode it, e.g. "
                         "iconv -f latin1 -t utf-8") from None
    docs = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno} is not valid JSON ({e})") from None
        if not isinstance(record, dict) or field not in record:
            present = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{path}:{lineno} has no text field {field!r}; fields present: {present}; "
                "pass --data.text_field"
            )
        text = record[field]
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: text field {field!r} holds a {type(text).__name__}, not a string; "
                             "point --data.text_field at the field that holds the text")
        docs.append((str(len(docs)), text or ""))
    return docs


def _rows_documents(rows, field: str, name: str) -> list[tuple[str, str]]:
    if field not in rows.column_names:
        raise ValueError(
            f"dataset {name!r} has no text field {field!r}; fields present: {rows.column_names}; "
            "pass --data.text_field"
        )
    texts = rows[field]
    bad = next((t for t in texts if t is not None and not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"dataset {name!r}: text field {field!r} holds {type(bad).__name__} values, not strings; "
                         "point --data.text_field at the field that holds the text")
    return [(str(i), text or "") for i, text in enumerate(texts)]


def _pick_split(dataset, spec: CorpusSpec, name: str):
    """A Dataset as is; from a DatasetDict the requested split ("train" falls back to the first)."""
    if not hasattr(dataset, "keys"):
        return dataset
    splits = list(dataset.keys())
    if spec.split in splits:
        return dataset[spec.split]
    if spec.split == "train" and splits:
        log.warning("dataset %s has no 'train' split; using %r", name, splits[0])
        return dataset[splits[0]]
    raise ValueError(f"dataset {name!r} has no split {spec.split!r}; splits present: {splits}")


def _saved_dataset_documents(path: Path, spec: CorpusSpec) -> list[tuple[str, str]]:
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as e:  # its JSON or Arrow files damaged: the reader's message names neither them nor the fix
        raise ValueError(f"corpus {str(path)!r} holds {', '.join(m for m in _DATASET_MARKERS if (path / m).exists())} "
                         f"as a datasets save_to_disk directory does, but datasets cannot read it ({type(e).__name__}: "
                         f"{e}); save the dataset again (save_to_disk), or pass its text as .txt/.jsonl files") from e
    rows = _pick_split(saved, spec, str(path))
    return _rows_documents(rows, spec.text_field, str(path))


def _hub_documents(name: str, spec: CorpusSpec) -> list[tuple[str, str]]:
    import datasets

    repo, _, config = name.partition(":")
    try:
        dataset = datasets.load_dataset(repo, config or None)
    except Exception as e:
        raise ConnectionError(
            f"could not load {name!r} from the Hugging Face hub ({type(e).__name__}: {e}). The hub is "
            "unreachable offline: on a machine with network run datasets.load_dataset(...)"
            ".save_to_disk(DIR) and pass DIR (or a .txt/.jsonl file) as the corpus source"
        ) from e
    return _rows_documents(_pick_split(dataset, spec, name), spec.text_field, name)


# ----------------------------------------------------------------------------- splitting


def _unit_hash(doc_id: str) -> float:
    """A uniform number in [0, 1) fixed by the id alone (sha1; Python's hash() is salted per run)."""
    return int(hashlib.sha1(doc_id.encode("utf-8")).hexdigest()[:15], 16) / 16**15


def split_documents(
    docs: list[tuple[str, str]], heldout_fraction: float, *, source: str = "corpus"
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Split documents into (calib, heldout) by a sha1 of each doc_id.

    A document is held out when its hash is below heldout_fraction, so its side never depends on
    the other documents. Each side comes back ordered by that same hash: a fixed shuffle, so the
    first packed rows mix many files instead of, say, only the stdlib's asyncio/ package.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    calib, heldout = [], []
    for doc in sorted(docs, key=lambda d: _unit_hash(d[0])):
        (heldout if _unit_hash(doc[0]) < heldout_fraction else calib).append(doc)
    if not calib or not heldout:
        empty = "calibration" if not calib else "held-out"
        raise ValueError(
            f"corpus {source!r}: the {empty} split is empty ({len(docs)} documents, "
            f"heldout_fraction={heldout_fraction}); pass a corpus with more documents or another fraction"
        )
    return calib, heldout


# ----------------------------------------------------------------------------- packing


def pack_tokens(
    docs: list[tuple[str, str]],
    tokenizer,
    seq_len: int,
    num_seqs: int,
    add_eos: bool = True,
    *,
    source: str = "corpus",
) -> torch.Tensor:
    """Tokenise docs in the given order, concatenate, cut into num_seqs rows of seq_len tokens.

    Rows are consecutive, non-overlapping windows of one token stream, so a row may span the end
    of one document (marked by eos, when the tokenizer has one) and the start of the next.
    Tokenisation stops as soon as enough tokens are collected: big corpora cost nothing extra.
    Returns a (num_seqs, seq_len) int64 tensor.
    """
    if seq_len < 1 or num_seqs < 1:
        raise ValueError(f"seq_len and num_seqs must be >= 1, got seq_len={seq_len}, num_seqs={num_seqs}")
    need = seq_len * num_seqs
    eos = tokenizer.eos_token_id if add_eos else None
    tokens: list[int] = []
    for _, text in docs:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        tokens.extend(ids)
        if eos is not None:
            tokens.append(eos)
        if len(tokens) >= need:
            break
    if not tokens:
        raise ValueError(f"corpus {source!r} is empty: its {len(docs)} documents give no tokens")
    if len(tokens) < need:
        raise ValueError(
            f"corpus {source!r} gives only {len(tokens)} tokens, need {num_seqs}*{seq_len}={need}; "
            "pass a bigger corpus or lower --data.calib_seqs / --data.eval_seqs / --data.seq_len"
        )
    return torch.tensor(tokens[:need], dtype=torch.long).view(num_seqs, seq_len)


def load_splits(spec: CorpusSpec, tokenizer, seq_len: int, calib_seqs: int, heldout_seqs: int) -> TokenSplits:
    """Calibration and held-out token rows from disjoint documents of one corpus (distillation's many training
    rows come from token shards instead: `write_tokens`)."""
    docs = load_documents(spec)
    calib_docs, heldout_docs = split_documents(docs, spec.heldout_fraction, source=spec.source)
    name = spec.source
    return TokenSplits(
        calib=pack_tokens(calib_docs, tokenizer, seq_len, calib_seqs, source=f"{name} (calibration split)"),
        heldout=pack_tokens(heldout_docs, tokenizer, seq_len, heldout_seqs, source=f"{name} (held-out split)"),
    )


# ----------------------------------------------------------------------------- token shards (distillation data)
#
# Distillation reads hundreds of millions of tokens: they are tokenised once per corpus and tokenizer, by
# `write_tokens` into the token cache (`cached_tokens`: the first `tokenize`, `distill` or `recovery` run that needs
# them), into one flat token stream per side of the document split,
# calib.bin and heldout.bin (uint16 when the vocabulary fits, else uint32; an eos between documents, as
# pack_tokens), beside tokens.json (the source, the split, the tokenizer's fingerprint, the token counts). Training
# reads fixed-length windows of calib.bin through a numpy memory map: memory does not grow with the budget, and the
# windows of a step are a pure function of (step, seed), `step_windows`.
#
# Why numpy memmaps and not the `datasets` library's Arrow files: a window is then one slice of one file, O(1)
# whatever its position, shared through the page cache by every torchrun process, with nothing to import or
# decode; Arrow stores documents as rows of varying length, so cutting fixed windows across document boundaries
# would need a prefix-sum index over them anyway. Tokenisation gets its parallelism from the fast tokenizer's
# batch encoding (Rust threads) instead of `num_proc` worker processes.

TOKENS_META = "tokens.json"
SIDES = ("calib", "heldout")
_ENCODE_BATCH = 256  # documents per batch call of the tokenizer


def check_readable(path: Path, source: str) -> None:
    """A local corpus (or shard directory) this process cannot read fails here, naming it, not on a file inside it."""
    if path.exists() and not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        raise PermissionError(f"corpus source {source!r} cannot be read (permission denied); fix its permissions or "
                              "pass a copy you can read")


def is_token_dir(source: str) -> bool:
    """Whether `source` is a token-shard directory: its tokens.json is one `write_tokens` wrote, or shard files lie
    beside it (damaged shards, named by their reader). A corpus of the user's holding a tokens.json is a corpus."""
    path = Path(source).expanduser()
    check_readable(path, source)
    return path.is_dir() and (path / TOKENS_META).exists() and (
        is_output_of(path, "tokenize") or any((path / f"{side}.bin").exists() for side in SIDES))


def _iter_split_documents(spec: CorpusSpec):
    """(side, text) of every document, side by the sha1 split. Local corpora: split_documents' order (calibration
    side first, each side in hash order), so the shards' first windows are load_splits' rows. "hf:" sources stream
    (datasets' streaming mode: nothing downloaded ahead), in the hub's order, split by the record index."""
    if spec.source.startswith("hf:"):
        import datasets

        repo, _, config = spec.source[3:].partition(":")
        try:
            rows = datasets.load_dataset(repo, config or None, split=spec.split, streaming=True)
        except Exception as e:
            raise ConnectionError(f"could not stream {spec.source!r} from the Hugging Face hub ({type(e).__name__}: "
                                  f"{e}); offline, save it with datasets' save_to_disk and pass the directory") from e
        for i, record in enumerate(rows):
            if spec.text_field not in record:
                raise ValueError(f"dataset {spec.source!r} has no text field {spec.text_field!r}; fields present: "
                                 f"{sorted(record)}; pass --data.text_field")
            yield ("heldout" if _unit_hash(str(i)) < spec.heldout_fraction else "calib"), record[spec.text_field] or ""
        return
    calib, heldout = split_documents(load_documents(spec), spec.heldout_fraction, source=spec.source)
    for side, docs in (("calib", calib), ("heldout", heldout)):
        for _, text in docs:
            yield side, text


def _listing_sha1(files: list[tuple[str, Path]]) -> str:
    """sha1 over every file's (name, size, mtime): what changes when a file is added, removed or written."""
    listing = []
    for name, f in files:
        st = f.stat()
        listing.append([name, st.st_size, st.st_mtime_ns])
    return hashlib.sha1(json.dumps(listing).encode()).hexdigest()


def corpus_stamp(source: str) -> dict | None:
    """What a corpus is now: its location, its file count and a sha1 over every file's (relative path, size, mtime).
    "builtin" and "pysrc" are stamped by the files they read (the Python install: another version, or a package
    installed or upgraded, stamps them differently); None for "hf:" sources. Token shards record it, so that shards
    of a corpus that changed since are not read as if they were its tokens."""
    if source.startswith("hf:"):
        return None
    if source in ("builtin", "pysrc"):
        files = _stdlib_files() + ([] if source == "builtin" else [(f"site/{r}", p) for r, p in _site_files()])
        where = f"{source} of {sysconfig.get_paths()['stdlib']}"
        return {"path": where, "files": len(files), "sha1": _listing_sha1(files)}
    root = Path(source).expanduser().resolve()
    if not root.exists():
        return None
    files = [root] if not root.is_dir() else sorted(p for p in root.rglob("*") if p.is_file())
    named = [(f.name if f == root else f.relative_to(root).as_posix(), f) for f in files]
    return {"path": str(root), "files": len(named), "sha1": _listing_sha1(named)}


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_token_meta(root: str | Path) -> dict:
    """tokens.json of a token-shard directory, checked: the shape `write_tokens` writes and shard files that hold the
    token counts it records. A damaged one is an error naming the file and the fix."""
    root = Path(root)
    f = root / TOKENS_META
    fix = f"delete {root} and tokenise the corpus again (`taylor-calibrate tokenize`, or let distill do it)"
    from taylor_calibrate.model.loading import read_json

    meta = read_json(f, fix)
    ok = (isinstance(meta, dict) and isinstance(meta.get("tokens"), dict) and isinstance(meta.get("tokenizer"), str)
          and meta.get("dtype") in ("uint16", "uint32") and isinstance(meta.get("source"), str)
          and isinstance(meta.get("corpus"), (dict, type(None)))
          and all(_count(meta["tokens"].get(s)) for s in SIDES)
          and isinstance(meta.get("documents"), dict) and all(_count(meta["documents"].get(s)) for s in SIDES))
    if not ok:
        raise ValueError(f"{f} is not a token-shard description (tokens, documents, tokenizer, dtype); {fix}")
    for side in SIDES:
        shard = root / f"{side}.bin"
        want = meta["tokens"][side] * np.dtype(meta["dtype"]).itemsize
        have = shard.stat().st_size if shard.is_file() else None
        if have != want:
            raise ValueError(f"token shard {shard} holds {have if have is not None else 'no'} bytes where "
                             f"{TOKENS_META} records {want}: it is missing, truncated or of another run; {fix}")
    return meta


def check_token_ids(root: str | Path, vocab_size: int) -> None:
    """Every id in the shards must be a token of the vocabulary (a damaged shard would index past the embedding)."""
    root = Path(root)
    meta = read_token_meta(root)
    for side in SIDES:
        ids = np.memmap(root / f"{side}.bin", dtype=meta["dtype"], mode="r") if meta["tokens"][side] else []
        step = 1 << 24
        top = max((int(ids[i:i + step].max()) for i in range(0, len(ids), step)), default=-1)
        if top >= vocab_size:
            raise ValueError(f"token shard {root / f'{side}.bin'} holds id {top}, beyond the tokenizer's {vocab_size} "
                             f"tokens: it is damaged; delete {root} and tokenise the corpus again")


def write_tokens(spec: CorpusSpec, tokenizer, out: str | Path, rebuild: bool = False,
                 shards: Path | None = None) -> Path:
    """Tokenise `spec`'s corpus once into `out` (see above); an existing `out` for the same corpus and tokenizer is
    reused, one for another is an error, and one whose corpus changed since is rewritten (`rebuild`) or an error.
    `shards`: a directory already holding this corpus's shards for this tokenizer (the cache, `cached_tokens`),
    whose files are linked (copied across file systems) instead. Written to a temporary directory and renamed
    (`staged_dir`): complete or absent. Holds `out`'s lock."""
    from taylor_calibrate.checkpoint import staged_dir
    from taylor_calibrate.checks import output_lock

    out = Path(out)
    fingerprint = tokenizer_fingerprint(tokenizer)
    want = {"source": spec.source, "text_field": spec.text_field, "split": spec.split,
            "heldout_fraction": spec.heldout_fraction, "tokenizer": fingerprint}
    with output_lock(out, "tokenize"):
        corpus = corpus_stamp(spec.source)
        if (out / TOKENS_META).exists():
            meta = read_token_meta(out)
            differ = {k: (meta.get(k), v) for k, v in want.items() if meta.get(k) != v}
            if differ:
                raise ValueError(f"token shards {out} were written for another corpus or tokenizer ({sorted(differ)} "
                                 "differ); pass another directory or delete it")
            then = meta.get("corpus")
            if not (then and corpus and then.get("sha1") != corpus["sha1"]):
                return out
            if not rebuild:
                raise ValueError(f"token shards {out} were written from {then.get('path')} ({then.get('files')} files) "
                                 f"as it was then; it changed since (now {corpus['files']} files, other sizes or "
                                 f"times). Delete {out} to tokenise it again, or pass another directory")
            log.warning("corpus %s changed since %s was written: tokenising it again", spec.source, out)
        elif out.exists() and any(out.iterdir()):
            raise FileExistsError(f"{out} exists and is not a token-shard directory; pass an empty or new directory")
        if shards is not None:
            with staged_dir(out) as tmp:
                for name in (TOKENS_META, *(f"{side}.bin" for side in SIDES)):
                    _link_or_copy(shards / name, tmp / name)
            log.info("token shards of %s: %s -> %s", spec.source, shards, out)
            return out
        eos = tokenizer.eos_token_id
        dtype = np.uint16 if len(tokenizer) <= 2 ** 16 else np.uint32
        counts, docs = dict.fromkeys(SIDES, 0), dict.fromkeys(SIDES, 0)
        pending = {side: [] for side in SIDES}
        with staged_dir(out) as tmp, contextlib.ExitStack() as files_open:
            files = {side: files_open.enter_context(open(tmp / f"{side}.bin", "wb")) for side in SIDES}

            def flush(side):
                texts, pending[side] = pending[side], []
                if not texts:
                    return
                stream = []
                for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
                    if ids:  # as pack_tokens: an empty document adds nothing, not even an eos
                        stream.extend(ids)
                        if eos is not None:
                            stream.append(eos)
                np.asarray(stream, dtype=dtype).tofile(files[side])
                counts[side] += len(stream)

            with tqdm(desc=f"tokenize {spec.source}", unit="doc", leave=False) as bar:
                for side, text in _iter_split_documents(spec):
                    pending[side].append(text)
                    docs[side] += 1
                    bar.update()
                    if len(pending[side]) >= _ENCODE_BATCH:
                        flush(side)
                for side in SIDES:
                    flush(side)
            for f in files.values():
                f.close()
            if not all(counts.values()):
                empty = [s for s in SIDES if not counts[s]]
                raise ValueError(f"corpus {spec.source!r}: the {empty} split gives no tokens; pass a bigger corpus or "
                                 "another heldout_fraction")
            meta = {**want, "corpus": corpus, "dtype": np.dtype(dtype).name, "eos": eos, "tokens": counts,
                    "documents": docs}
            (tmp / TOKENS_META).write_text(json.dumps(meta, indent=1))
    log.info("tokenised %s: %s tokens (calibration / held-out) -> %s", spec.source,
             " / ".join(f"{counts[s]:,}" for s in SIDES), out)
    return out


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (shards are never written in place, so a link is as good as a copy), else a copy. A link shares
    its file's mode: only a file already of the mode this run's umask gives is linked, so that making `dst` readable
    as this run's umask says never changes the cache's file, nor an earlier output linked to it (made under another
    umask)."""
    if stat.S_IMODE(src.stat().st_mode) == 0o666 & ~umask():
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copyfile(src, dst)


# The token cache: shards written once per (corpus as it is now, tokenizer, split), shared by every command and run
# of the user (`distill`, `recovery`, `tokenize`), each entry a directory of `write_tokens` named by a digest of its
# key. A changed corpus (`corpus_stamp`: its files' sizes and times; for builtin / pysrc the Python install) or
# another tokenizer gives another key, so stale shards are never read; old entries stay until the cache is deleted
# (any time no run is reading it).
def cache_entry(spec: CorpusSpec, tokenizer) -> Path:
    """The cache directory of `spec`'s corpus as it is now, tokenised by `tokenizer`: <cache>/<name>-<digest of the
    source, its corpus_stamp, the tokenizer's fingerprint and the split>."""
    local = spec.source not in ("builtin", "pysrc") and not spec.source.startswith("hf:")
    source = str(Path(spec.source).expanduser().resolve()) if local else spec.source
    key = {"format": 1, "source": source, "corpus": corpus_stamp(spec.source),
           "tokenizer": tokenizer_fingerprint(tokenizer), "text_field": spec.text_field, "split": spec.split,
           "heldout_fraction": spec.heldout_fraction}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    name = "".join(c if c.isalnum() or c in "._" else "_" for c in (Path(source).name if local else source))
    return token_cache_dir(spec.token_cache) / f"{name[:40]}-{digest}"


def cached_tokens(spec: CorpusSpec, tokenizer) -> Path:
    """`spec`'s corpus as token shards for `tokenizer`, from the cache (`cache_entry`), tokenised there first if
    absent. Under the entry's lock: of two processes asking at once, one tokenises and the other waits, then reads
    it. A damaged entry is written again."""
    entry = cache_entry(spec, tokenizer)
    with waiting_lock(entry.parent / ".locks" / entry.name, str(entry)):
        if (entry / TOKENS_META).exists():
            try:
                read_token_meta(entry)
                log.info("token shards of %s from the cache: %s", spec.source, entry)
                return entry
            except ValueError as e:
                log.warning("%s; tokenising it again", e)
                shutil.rmtree(entry)
        return write_tokens(spec, tokenizer, entry)


class TokenWindows:
    """Consecutive non-overlapping windows of seq_len tokens of one side's stream, read from its memory map on
    demand: windows[idx] -> (len(idx), seq_len) int64, the rows pack_tokens would give for the same documents."""

    def __init__(self, root: str | Path, side: str, seq_len: int):
        root = Path(root)
        meta = read_token_meta(root)
        self.root, self.side, self.seq_len, self.meta = root, side, seq_len, meta
        self.tokens = np.memmap(root / f"{side}.bin", dtype=meta["dtype"], mode="r", shape=(meta["tokens"][side],))
        self.num = len(self.tokens) // seq_len
        if self.num < 1:
            raise ValueError(f"token shards {root}: the {side} side holds {len(self.tokens)} tokens, fewer than one "
                             f"window of {seq_len}; pass a bigger corpus or a shorter --data.seq_len")

    @property
    def shape(self) -> tuple[int, int]:
        return self.num, self.seq_len

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, idx) -> torch.Tensor:
        idx = torch.as_tensor(idx, dtype=torch.long).reshape(-1).tolist()
        T = self.seq_len
        return torch.from_numpy(np.stack([self.tokens[i * T:(i + 1) * T] for i in idx]).astype(np.int64))

    def first(self, n: int) -> torch.Tensor:
        """The first n windows as one tensor (held-out evaluation rows, calibration rows)."""
        if n > self.num:
            raise ValueError(f"token shards {self.root}: the {self.side} side gives {self.num} windows of "
                             f"{self.seq_len} tokens, fewer than the {n} asked; pass a bigger corpus or fewer rows")
        return self[range(n)]


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num: int, seed: int, epoch: int) -> torch.Tensor:
    key = int(hashlib.sha1(f"{seed}:{epoch}".encode()).hexdigest()[:15], 16)
    return torch.randperm(num, generator=torch.Generator().manual_seed(key))


def step_windows(num: int, batch_size: int, step: int, seed: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Window indices of optimizer step `step` (1-based) for process `rank` of `world`: the step's global batch is
    the next batch_size entries of an endless sequence of seeded permutations of range(num), one per epoch, and each
    process takes its contiguous share. A pure function of its arguments (a resumed run reads the same data; k
    processes read the 1-process batch between them); memory O(num), whatever the number of steps."""
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size} must be a multiple of the {world} processes")
    per = batch_size // world
    pos, end = (step - 1) * batch_size + rank * per, (step - 1) * batch_size + (rank + 1) * per
    out = []
    while pos < end:
        epoch, off = divmod(pos, num)
        take = min(end - pos, num - off)
        out.append(_epoch_permutation(num, seed, epoch)[off:off + take])
        pos += take
    return torch.cat(out)


def repeat_spans(ids: torch.Tensor, windows: torch.Tensor, fraction: float, seed: int, step: int) -> torch.Tensor:
    """Rows carrying retrieval: in about `fraction` of the rows a span of the row's own text from its first half is
    written again at a random place in its second half (span length T/128 to T/32 tokens, gap up to ~T). Once the copy
    has begun, the teacher predicts it by attending back over the gap, the signal a hybrid needs to keep retrieval.

    A pure function of (seed, step, window index) per row, so a resumed run and any number of processes see the same
    rows; returns a new tensor (`ids` is left as it was). `windows`: the rows' window indices."""
    B, T = ids.shape
    if fraction <= 0 or T < 16:
        return ids
    out = ids.clone()
    lo, hi = max(2, T // 128), max(2, T // 32)
    for r, w in enumerate(windows.tolist()):
        key = int(hashlib.sha1(f"{seed}:{step}:{w}".encode()).hexdigest()[:15], 16)
        g = torch.Generator().manual_seed(key)
        if torch.rand((), generator=g).item() >= fraction:
            continue
        n = int(torch.randint(lo, hi + 1, (), generator=g))
        src = int(torch.randint(0, T // 2 - n + 1, (), generator=g))
        dst = int(torch.randint(T // 2, T - n + 1, (), generator=g))
        out[r, dst:dst + n] = ids[r, src:src + n]
    return out


def recall_rows(ids: torch.Tensor, windows: torch.Tensor, fraction: float, seed: int, step: int) -> torch.Tensor:
    """Rows carrying multi-key recall: in about `fraction` of the rows, k (2 to 6) needles "F K_i V_i" are written
    over the row's own text, one in each of k equal slots of its first three quarters, and one of them, "F K_j V_j",
    again in its last quarter. F (a frame, 3-8 tokens), the keys K_i (2-4 tokens) and the values V_i (4-8 tokens) are
    spans of the row's own text: the needles share their frame and differ in key and value, so predicting V_j at
    the end means matching K_j among k look-alike needles, what the teacher does by attention and a recurrent state
    blurs. Built from the training text alone (no template, no evaluation haystack).

    A pure function of (seed, step, window index) per row, as `repeat_spans`; returns a new tensor."""
    T = ids.shape[1]
    if fraction <= 0 or T < 256:
        return ids
    out = ids.clone()
    for r, w in enumerate(windows.tolist()):
        key = int(hashlib.sha1(f"recall:{seed}:{step}:{w}".encode()).hexdigest()[:15], 16)
        g = torch.Generator().manual_seed(key)
        if torch.rand((), generator=g).item() >= fraction:
            continue
        k = int(torch.randint(2, 7, (), generator=g))

        def span(lo: int, hi: int) -> torch.Tensor:
            n = int(torch.randint(lo, hi + 1, (), generator=g))
            at = int(torch.randint(0, T - n + 1, (), generator=g))
            return ids[r, at:at + n]

        frame = span(3, 8)
        needles = [torch.cat([frame, span(2, 4), span(4, 8)]) for _ in range(k)]  # F K_i V_i
        slot = (3 * T // 4) // k
        for i, nd in enumerate(needles):
            at = i * slot + int(torch.randint(0, slot - len(nd) + 1, (), generator=g))
            out[r, at:at + len(nd)] = nd
        nd = needles[int(torch.randint(0, k, (), generator=g))]
        at = int(torch.randint(3 * T // 4, T - len(nd) + 1, (), generator=g))
        out[r, at:at + len(nd)] = nd
    return out


_SPLIT_OPTIONS = {"text_field": str, "split": str, "heldout_fraction": float}  # fixed when shards are written


def adopt_shard_split(spec, meta: dict, root: Path, main: bool = True) -> None:
    """Token shards were split (and their documents read) once, by `tokenize`: a --data.heldout_fraction, text_field
    or split given with them does not apply, and recording it in the run's results would describe rows it never
    used. The shards' own values go into `spec`, with a warning where they differ."""
    for name, kind in _SPLIT_OPTIONS.items():
        value = meta.get(name)
        if isinstance(value, kind) and value != getattr(spec, name):
            if main:
                log.warning("token shards %s were made with --data.%s %r: the %r given does not apply to them; the "
                            "run uses and records %r (tokenise again to change it)", root, name, value,
                            getattr(spec, name), value)
            setattr(spec, name, value)


def distill_data(spec, tokenizer, budget: int, *, main: bool = True,
                 barrier=None) -> tuple[TokenWindows, torch.Tensor]:
    """(training windows, held-out rows) for distillation: from `spec.source` when it is a token-shard directory,
    else from the token cache (`cached_tokens`: tokenised on first use by the main process; the others wait at
    `barrier`). The held-out rows are the first spec.eval_seqs windows of the held-out side."""
    if is_token_dir(spec.source):
        root = Path(spec.source).expanduser()
        meta = read_token_meta(root)
        if main and meta["tokenizer"] != tokenizer_fingerprint(tokenizer):
            raise ValueError(f"token shards {root} were written with another tokenizer than the model's; run "
                             "`taylor-calibrate tokenize` with this model")
        adopt_shard_split(spec, meta, root, main)
    else:
        root = cached_tokens(spec, tokenizer) if main else cache_entry(spec, tokenizer)
    if main:
        check_token_ids(root, len(tokenizer))
    if barrier is not None:
        barrier()
    train = TokenWindows(root, "calib", spec.seq_len)
    epochs = budget / (len(train) * spec.seq_len)
    if epochs > 1:
        log.warning("corpus %r gives %d training windows of %d tokens (%s tokens), fewer than the budget of %s: "
                    "training repeats them (%.1f epochs)", train.meta["source"], len(train), spec.seq_len,
                    f"{len(train) * spec.seq_len:,}", f"{budget:,}", epochs)
    return train, TokenWindows(root, "heldout", spec.seq_len).first(spec.eval_seqs)


@writes_out("tokenize")
def run_tokenize(args) -> dict:
    """Tokenise a corpus once into memory-mapped token shards (calibration / held-out documents) for `distill` and
    `recovery`; pass the directory as their --data.source. The shards go through the token cache: a corpus already
    tokenised for this tokenizer is linked, not tokenised again, and distill / recovery reuse what this writes."""
    from taylor_calibrate.teacher import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    out = write_tokens(args.data, tokenizer, args.out, rebuild=True, shards=cached_tokens(args.data, tokenizer))
    meta = read_token_meta(out)
    tokens, docs = meta["tokens"], meta["documents"]
    print(f"token shards {out}: {tokens['calib']:,} calibration / {tokens['heldout']:,} held-out tokens from "
          f"{docs['calib']:,} / {docs['heldout']:,} documents of {args.data.source}")
    return meta
