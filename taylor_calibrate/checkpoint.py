"""Export: save a hybrid (safetensors + config + tokenizer + report.json) and load it back with clear errors.

A model directory appears complete or not at all: it is written into a temporary sibling and renamed into place, so
an earlier output is replaced only by that rename; a distill run's model/ counts as complete once the run's
report.json, written last, stands beside it (`check_finished`). Readers refuse a directory whose weights are corrupt,
do not cover every parameter of its config, are not finite, or whose report.json disagrees with its config.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from taylor_calibrate.model.loading import (REPORT, check_loaded, check_report, check_tokenizer_fits,
                                            check_tokenizer_recorded, read_json)
from taylor_calibrate.results import finished, is_output_of, umask, write_json

log = logging.getLogger("taylor_calibrate")


def unreadable(e: BaseException) -> OSError | None:
    """A permission error met while loading, as one error naming the file and the fix (not "damaged")."""
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM):
        return PermissionError(f"cannot read {e.filename or 'a file'} ({e.strerror}); fix its permissions, or pass a "
                               "copy you can read")
    return None


def tokenizer_error(spec: str, e: BaseException, fix: str) -> Exception:
    """The one error for a tokenizer that did not load: unreadable, needing custom code, or damaged."""
    if denied := unreadable(e):
        return denied
    if "custom code" in str(e):
        return ValueError(f"the tokenizer of {spec!r} needs custom code (an auto_map in its tokenizer_config.json), "
                          "which taylor-calibrate never runs; pass a model whose tokenizer transformers reads itself")
    return ValueError(f"could not load the tokenizer in {spec} ({type(e).__name__}: {e}): its tokenizer files are "
                      f"damaged; {fix}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def waiting_lock(path: Path, what: str):
    """An exclusive flock on `path`, waiting while another process holds it (the OS drops a dead holder's): of two
    processes filling one cache entry at once, one writes and the other waits, then reads it."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            log.info("waiting for another process writing %s", what)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def staged_dir(final: str | Path):
    """Yield an empty temporary sibling of `final` to write a directory into; on success it is renamed to `final`
    (an earlier `final` is moved aside and removed only after that), on any error it is removed. Leftovers of killed
    runs (`.<name>.partial-<pid>` of a dead process) are cleared first. What it holds gets the modes the umask says
    (`as_umask`), and a failed write is named (`write_errors`)."""
    final = Path(final)
    if final.is_symlink():  # a link to the output: the link stays, the directory it leads to is replaced
        final = final.resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{final.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with write_errors(final, tmp):
            yield tmp
        as_umask(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def as_umask(root: str | Path) -> None:
    """Give `root` and everything under it the modes the umask says (files 0644, directories 0755 by default):
    temporary directories and safetensors' files are created 0700 / 0600, which a serving account could not read."""
    mask = umask()
    root = Path(root)
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.EFBIG)


@contextlib.contextmanager
def write_errors(target: str | Path, staged: str | Path | None = None):
    """Turn a failed write under `target` (or `staged`, where it is written first: a full disk, no permission: an
    OSError, or safetensors' own error, which is not one) into one OSError naming `target` and the fix. An error on a
    file elsewhere (an input that cannot be read) is not a failed write: it passes unchanged."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        # numpy's tofile (the GGUF writer's, the token shards') reports a short write as "N requested and M written"
        short = isinstance(e, OSError) and e.errno is None and "written" in str(e)
        if isinstance(e, OSError) and e.errno not in _WRITE_ERRNOS and not short:
            raise
        where = Path(os.path.abspath(e.filename)) if getattr(e, "filename", None) else None
        ours = [Path(os.path.abspath(p)) for p in (target, staged) if p is not None]
        if where is not None and not any(where == p or p in where.parents for p in ours):
            raise
        why = getattr(e, "strerror", None) or str(e)
        if isinstance(e, SafetensorError) and ("code: 28" in why or "StorageFull" in why):
            why = "no space left on the device"
        elif short:
            why = f"only part of a write reached the disk ({e}): no space left on the device"
        raise OSError(f"could not write {target} ({why}); nothing was kept: free space or fix the permissions there, "
                      "or pass another --out") from e


def check_finite(model_or_tensors, what: str, fix: str = "") -> None:
    """Raise naming the first parameter (and its layer) that holds a NaN or inf; takes a model or a state dict."""
    named = model_or_tensors.items() if isinstance(model_or_tensors, dict) else model_or_tensors.named_parameters()
    for name, p in named:
        if not bool(torch.isfinite(p).all()):
            bad = int((~torch.isfinite(p)).sum())
            layer = next((f" (layer {part})" for prev, part in zip(name.split("."), name.split(".")[1:])
                          if prev == "layers"), "")
            raise ValueError(f"{what} has non-finite weights: {bad} NaN/inf values in {name}{layer}"
                             + (f"; {fix}" if fix else ""))


def save_hybrid(model, tokenizer, out_dir: str | Path, report: dict | None = None) -> Path:
    """Write model + tokenizer (+ report.json) as one directory, complete or not at all; non-finite weights are
    refused rather than saved."""
    check_finite(model, "the model to save")
    out = Path(out_dir)
    with staged_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if report is not None:
            write_json(tmp / REPORT, report)
    return out


def check_finished(path: Path) -> None:
    """The model/ of a distill output is complete once the run has written its report.json beside it (last:
    `results.finished`): without one (the run stopped between the two writes, or is being resumed) it is refused."""
    out = Path(path).resolve().parent
    if Path(path).resolve().name == "model" and is_output_of(out, "distill") and not finished(out):
        raise ValueError(f"{path} is the model of the distill run in {out}, which has not finished: its report.json, "
                         "written last, is missing (the run stopped before it, or is being resumed); run that distill "
                         "command again to finish it (it resumes), or pass a finished model")


def check_safetensors(path: Path, fix: str) -> list[Path]:
    """The directory's *.safetensors files, each with a readable header and data that covers it."""
    from safetensors import safe_open

    weights = sorted(path.glob("*.safetensors"))
    for w in weights:
        if not w.is_file():  # a pipe would block the reader
            raise ValueError(f"checkpoint file {w} is not a regular file (a pipe, socket or device); {fix}")
        try:
            open(w, "rb").close()
        except OSError as e:  # unreadable is not damaged: say which it is
            raise OSError(f"cannot read {w} ({e.strerror}); fix its permissions, or pass a copy you can read") from None
        try:
            with safe_open(str(w), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise ValueError(f"checkpoint file {w} is corrupt or truncated ({e}); {fix}") from e
    return weights


def check_state(path, config, state: dict, fix: str) -> None:
    """Raw weights of a hybrid directory (read without building the model, as `export` does) against its config:
    every parameter present with its shape, nothing else, all finite; and its report.json agreeing."""
    from transformers.initialization import no_init_weights

    from taylor_calibrate.model.hybrid import HybridForCausalLM

    with torch.device("meta"), no_init_weights():
        expected = {k: tuple(v.shape) for k, v in HybridForCausalLM(config).state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    state_keys = set(state) - ({"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set())
    info = {"missing_keys": sorted(set(expected) - state_keys), "unexpected_keys": sorted(state_keys - set(expected)),
            "mismatched_keys": sorted(k for k in set(expected) & state_keys if tuple(state[k].shape) != expected[k])}
    check_loaded(path, info, fix, unexpected=True)
    check_report(path, config)
    check_finite(state, str(path), fix)


def check_model_path(path: Path) -> None:
    """`path` is a model directory (a config.json in it) whose writer finished: a distill run's directory names its
    model/ inside, any other wrong path the output of `convert` to pass instead."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory; pass the output directory of `convert`")
    if not (path / "config.json").exists():
        if is_output_of(path, "distill"):
            raise FileNotFoundError(f"{path} is a distill run's directory; its model is {path / 'model'}")
        raise FileNotFoundError(f"{path} is not a model directory (no config.json); pass the output of `convert`")
    check_finished(path)


def load_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Load a saved hybrid (or any causal LM directory) and its tokenizer; corrupt, partial, mixed or non-finite
    directories get an error that names the file and the fix instead of a stack trace or a silently wrong model."""
    import taylor_calibrate  # noqa: F401  registers the hybrid with the Auto* factories

    path = Path(path)
    fix = REWRITE
    check_model_path(path)
    check_json_files(path, fix)
    cfg = json.loads((path / "config.json").read_text())
    check_model_type(path, cfg, fix)
    check_hybrid_config(path, cfg, fix)
    if not (found := check_safetensors(path, fix)):
        raise FileNotFoundError(f"{path} has no *.safetensors weights; re-run `convert` to write them")
    if not any((path / n).exists() for n in ("model.safetensors", "model.safetensors.index.json")):
        raise FileNotFoundError(f"{path} holds {', '.join(Path(f).name for f in found)} but no model.safetensors (or "
                                "model.safetensors.index.json), the names the loader reads; rename the file")
    try:  # weights of another shape than the config's are named by check_loaded, not raised as a page of shapes
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True,
                                                           ignore_mismatched_sizes=True, trust_remote_code=False)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError) as e:
        if "custom code" in str(e):
            raise ValueError(f"{path} needs custom code (an auto_map in its config), which taylor-calibrate never "
                             "runs; pass a hybrid made by `convert` or a checkpoint of a supported architecture") from None
        raise ValueError(f"could not load the model in {path}: {e}") from e
    check_loaded(path, info, fix)
    check_report(path, model.config)
    check_finite(model, str(path), "the file is damaged or the run that wrote it diverged; " + fix)
    tokenizer = None
    check_tokenizer_files(path)
    if any(path.glob("tokenizer*")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except Exception as e:  # a damaged tokenizer file surfaces as whatever its reader meets
            raise tokenizer_error(str(path), e, "copy them again from the teacher it was converted from") from e
    check_tokenizer_fits(path, model, tokenizer, "copy them again from the teacher it was converted from")
    check_tokenizer_recorded(path, tokenizer, model.config, "copy them again from the teacher it was converted from")
    return model.to(device).eval(), tokenizer


def check_tokenizer_files(path: Path, fix: str = "copy it again from the teacher it was converted from") -> None:
    """A model directory with a tokenizer's vocabulary but no tokenizer_config.json loads a tokenizer without its
    special tokens (eos, pad), which a reader then takes for another tokenizer or, exporting, writes out wrong."""
    if (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"{path} holds tokenizer.json but no tokenizer_config.json (the tokenizer's special "
                                f"tokens: eos, pad); {fix}")


REWRITE = "re-run `convert` into a new --out to rewrite it"
_JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
               "special_tokens_map.json")  # report.json: model.loading.check_report


_READ_SUFFIXES = (".json", ".safetensors", ".bin", ".model", ".txt", ".jinja", ".gguf")


def check_regular_files(path: Path, fix: str) -> None:
    """What transformers' loaders read in a model directory (its JSON files, tokenizer files, vocabularies, merges,
    chat templates, weights) must be regular files: a pipe would block the reader for ever, a device or a directory
    fail deep inside it."""
    for f in sorted(Path(path).iterdir()):
        if (f.name.startswith("tokenizer") or f.suffix in _READ_SUFFIXES) and not f.is_file():
            what = (f"a link to {os.readlink(f)}, which does not exist" if f.is_symlink() and not f.exists() else
                    "not a regular file (a directory, pipe, socket or device)")
            raise ValueError(f"{f} is {what}; {fix}")


def check_json_files(path: Path, fix: str) -> None:
    """The JSON files a model directory may hold must be regular files (a pipe would block the reader) holding a
    JSON object; so must every other file a loader reads there (`check_regular_files`)."""
    check_regular_files(path, fix)
    for name in _JSON_FILES:
        f = path / name
        if not f.exists():
            continue
        if not f.is_file():
            raise ValueError(f"{f} is not a regular file (a pipe, socket or device); {fix}")
        read_json(f, fix)


def _attention_heads_problems(heads: dict, types: list, base: dict) -> list[str]:
    """attention_heads must give every head-wise layer (and only those) the KV groups it keeps: distinct group
    indices of the teacher's, some but not all of them."""
    from taylor_calibrate.model.hybrid_config import HEADWISE_TYPES

    headwise = {str(i) for i, t in enumerate(types) if t in HEADWISE_TYPES.values()}
    kv = base.get("num_key_value_heads") or base.get("num_attention_heads")
    problems = []
    if set(heads) != headwise:
        problems.append(f"attention_heads names layers {sorted(heads, key=str)} where layer_types has head-wise "
                        f"layers {sorted(headwise, key=int)}")
    for layer, groups in heads.items():
        ok = isinstance(groups, list) and groups and all(isinstance(g, int) and not isinstance(g, bool) for g in groups)
        ok = ok and len(set(groups)) == len(groups) and (not isinstance(kv, int) or
                                                          (all(0 <= g < kv for g in groups) and len(groups) < kv))
        if not ok:
            problems.append(f"attention_heads[{layer!r}] = {groups!r} is not a list of the KV groups the layer keeps "
                            f"(distinct integers in [0, {kv}), fewer than {kv})")
    return problems


def check_model_type(path: Path, cfg: dict, fix: str) -> None:
    """config.json's model_type must be one transformers knows (ours registered): else its loader fails with a page
    on upgrading transformers, where the file is what is wrong."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import taylor_calibrate  # noqa: F401  registers the hybrid's model_type

    model_type = cfg.get("model_type")
    if "auto_map" in cfg:
        return  # the loader names the custom code it would need, which is never run
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        what = "gives no model_type" if model_type is None else f"gives model_type {model_type!r}, which transformers " \
            "does not know"
        raise ValueError(f"{path / 'config.json'} {what}: it is damaged (or the model is of another library); {fix}")


def check_hybrid_config(path: Path, cfg: dict, fix: str) -> None:
    """A hybrid's config.json must have the shape `convert` writes: a layer kind per layer of its base config, its
    options, its teacher a path or null, and none of the keys the config computes. Anything else would load another
    model than the one saved, or fail deep in transformers."""
    from taylor_calibrate.model.hybrid_config import ATTENTION_TYPES, HEADWISE_TYPES, MIXER_TYPE

    if cfg.get("model_type") != "taylor_hybrid":
        return
    base, types = cfg.get("base_config"), cfg.get("layer_types")
    kinds = (*ATTENTION_TYPES, MIXER_TYPE, *HEADWISE_TYPES.values())
    n = base.get("num_hidden_layers") if isinstance(base, dict) else None
    problems = []
    if not isinstance(base, dict) or not isinstance(n, int) or n < 1:
        problems.append("base_config is not the teacher's config (an object with num_hidden_layers)")
    else:
        from taylor_calibrate.model.hybrid import base_config_of

        try:  # a value of the wrong type fails in transformers' config class, inside the model's constructor
            base_config_of(SimpleNamespace(base_config=base))
        except Exception as e:  # a validation error of the config class, or a model_type it does not know
            problems.append(f"base_config is not a config transformers can read ({type(e).__name__}: "
                            f"{' '.join(str(e).split())})")
    if not isinstance(types, list) or not all(t in kinds for t in types):
        problems.append(f"layer_types is not a list of layer kinds ({', '.join(kinds)})")
    elif isinstance(n, int) and len(types) != n:
        problems.append(f"layer_types lists {len(types)} layers where base_config.num_hidden_layers is {n}")
    for key, kind in (("teacher_name", str), ("attention_heads", dict), ("mixer", str)):
        if cfg.get(key) is not None and not isinstance(cfg[key], kind):
            problems.append(f"{key} is of type {type(cfg[key]).__name__}, not {kind.__name__}")
    mixer = cfg.get("mixer") if isinstance(cfg.get("mixer"), str) else "gdn"
    if mixer in cfg and not isinstance(cfg[mixer], dict):
        problems.append(f"{mixer} (the mixer's options) is of type {type(cfg[mixer]).__name__}, not an object")
    elif isinstance(cfg.get(mixer), dict):
        from taylor_calibrate.model.mixers import get_spec

        try:  # values of the wrong type or out of range fail in the model's constructor, far from the file
            get_spec(mixer).options(cfg[mixer])
        except (TypeError, ValueError) as e:
            problems.append(f"its {mixer} options are not valid ({e})")
    if isinstance(types, list) and all(t in kinds for t in types) and isinstance(cfg.get("attention_heads") or {}, dict):
        problems += _attention_heads_problems(cfg.get("attention_heads") or {}, types, base if isinstance(base, dict)
                                              else {})
    computed = sorted({"gdn_layers", "mixer_options"} & set(cfg))
    if computed:
        problems.append(f"it sets {computed}, which the config computes from layer_types")
    if problems:
        raise ValueError(f"{path / 'config.json'} is not a hybrid config as `convert` writes it: {'; '.join(problems)}"
                         f"; it is damaged: {fix}")
