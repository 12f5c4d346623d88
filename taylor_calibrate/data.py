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

import hashlib
import json
import logging
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Directories of the standard library that are not ordinary library source: tests are full of
# deliberately odd code, idlelib is an application, config-* and _sysconfigdata* describe the build.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk
_CHUNK_CHARS = 2000  # a single text file is cut into documents of about this many characters


@dataclass
class CorpusSpec:
    """Where the text comes from and how much of it is held out."""

    source: str = "builtin"
    """"builtin" (Python stdlib source), a text file, a directory of text files, a .jsonl file,
    a directory written by `datasets.Dataset.save_to_disk`, or "hf:<name>[:<config>]" (needs network)."""
    text_field: str = "text"
    """Field holding the text in .jsonl records and `datasets` rows."""
    split: str = "train"
    """Split of a saved DatasetDict; the default "train" falls back to the first split if absent."""
    heldout_fraction: float = 0.5
    """Expected fraction of documents held out for perplexity, in (0, 1)."""


@dataclass
class TokenSplits:
    calib: torch.Tensor  # (calib_seqs, seq_len) int64, from calibration documents only
    heldout: torch.Tensor  # (heldout_seqs, seq_len) int64, from held-out documents only
    train: torch.Tensor | None = None  # (<= train_seqs, seq_len) int64, from calibration documents only


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
    elif source.startswith("hf:"):
        docs = _hub_documents(source[3:], spec)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(
                f"corpus source {source!r} does not exist; pass 'builtin', a text file, a directory, "
                "a .jsonl file, a datasets save_to_disk directory, or 'hf:<name>'"
            )
        if path.is_dir() and any((path / m).exists() for m in _DATASET_MARKERS):
            docs = _saved_dataset_documents(path, spec)
        elif path.is_dir():
            docs = _directory_documents(path)
        elif path.suffix == ".jsonl":
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


def _stdlib_documents() -> list[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        dirs = rel.parts[:-1]
        if any(d in _STDLIB_SKIP_DIRS or d.startswith("config-") for d in dirs):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        text = _read_text(path)
        if text is not None:
            docs.append((rel.as_posix(), text))
    return docs


def _directory_documents(root: Path) -> list[tuple[str, str]]:
    """Every text file under root, recursively, sorted; hidden files/dirs (.git) and binaries skipped."""
    docs, skipped = [], 0
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        text = _read_text(path)
        if text is None:
            skipped += 1
            continue
        docs.append((rel.as_posix(), text))
    if skipped:
        log.info("corpus %s: skipped %d binary or non-UTF-8 files", root, skipped)
    if not docs:
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
    docs = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
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
                    "pass --text-field"
                )
            text = record[field]
            docs.append((str(len(docs)), "" if text is None else str(text)))
    return docs


def _rows_documents(rows, field: str, name: str) -> list[tuple[str, str]]:
    if field not in rows.column_names:
        raise ValueError(
            f"dataset {name!r} has no text field {field!r}; fields present: {rows.column_names}; "
            "pass --text-field"
        )
    return [(str(i), text or "") for i, text in enumerate(rows[field])]


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

    rows = _pick_split(datasets.load_from_disk(str(path)), spec, str(path))
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
    at_most: bool = False,
) -> torch.Tensor:
    """Tokenise docs in the given order, concatenate, cut into num_seqs rows of seq_len tokens.

    Rows are consecutive, non-overlapping windows of one token stream, so a row may span the end
    of one document (marked by eos, when the tokenizer has one) and the start of the next.
    Tokenisation stops as soon as enough tokens are collected: big corpora cost nothing extra.
    Returns a (num_seqs, seq_len) int64 tensor; with at_most=True, as many whole rows as the corpus gives (up to
    num_seqs) instead of an error when it is short.
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
    if at_most and len(tokens) >= seq_len:
        num_seqs = min(num_seqs, len(tokens) // seq_len)
        need = seq_len * num_seqs
    if len(tokens) < need:
        raise ValueError(
            f"corpus {source!r} gives only {len(tokens)} tokens, need {num_seqs}*{seq_len}={need}; "
            "pass a bigger corpus or lower --num-seqs/--seq-len"
        )
    return torch.tensor(tokens[:need], dtype=torch.long).view(num_seqs, seq_len)


def load_splits(spec: CorpusSpec, tokenizer, seq_len: int, calib_seqs: int, heldout_seqs: int,
                train_seqs: int = 0) -> TokenSplits:
    """Calibration and held-out token rows from disjoint documents of one corpus; with train_seqs > 0 also up to
    that many training rows (distillation) from the calibration documents, which a small corpus may cut short:
    training cycles through them."""
    docs = load_documents(spec)
    calib_docs, heldout_docs = split_documents(docs, spec.heldout_fraction, source=spec.source)
    name = spec.source
    train = None
    if train_seqs > 0:
        train = pack_tokens(calib_docs, tokenizer, seq_len, train_seqs, source=f"{name} (calibration split)",
                            at_most=True)
        if train.shape[0] < train_seqs:
            log.warning("corpus %r gives %d training rows of %d tokens, fewer than the %d the budget covers: "
                        "training repeats them (%.1f epochs)", name, train.shape[0], seq_len, train_seqs,
                        train_seqs / train.shape[0])
    if train is not None and train.shape[0] >= calib_seqs:  # the same token stream: reuse its first rows
        calib = train[:calib_seqs].clone()
    else:
        calib = pack_tokens(calib_docs, tokenizer, seq_len, calib_seqs, source=f"{name} (calibration split)")
    return TokenSplits(
        calib=calib,
        heldout=pack_tokens(heldout_docs, tokenizer, seq_len, heldout_seqs, source=f"{name} (held-out split)"),
        train=train,
    )
