"""Load-time checks of a saved model directory, applied by the hybrid's `from_pretrained` and by checkpoint.py's
readers: weights that do not cover the config, or a report.json that describes another model, are refused with the
fix. The model uses them; checkpoint I/O lives in checkpoint.py, which the model does not import."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

REPORT = "report.json"


class NotRegularFile(ValueError):
    pass


def read_text(path, fix: str) -> str:
    """The text of a file this package wrote (a report, a checkpoint's state, metrics, a shard description): a pipe,
    device or directory in its place is refused naming it (a reader would block for ever, or fail without the name)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise NotRegularFile(f"{path} is not a regular file (a directory, pipe, socket or device)"
                             + (f"; {fix}" if fix else ""))
    try:
        return path.read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not text ({e}): it is damaged or not a file of ours"
                         + (f"; {fix}" if fix else "")) from None


class NotJSON(ValueError):
    """Text that does not parse as JSON at all (a half-written last line of a .jsonl, say)."""


def parse_json(text: str, where, fix: str, kind: type = dict):
    """JSON text of a file of ours at `where` (a path, or path:line), of top-level type `kind`: text that is not JSON
    (NotJSON), nests deeper than Python's recursion limit (RecursionError in the parser, no file named) or holds
    another type is one ValueError naming `where` and `fix`."""
    fix = f"; {fix}" if fix else ""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise NotJSON(f"{where} is not valid JSON ({e}){fix}") from None
    except RecursionError:
        raise ValueError(f"{where} nests JSON deeper than Python's recursion limit: it is damaged{fix}") from None
    if not isinstance(data, kind):
        want = {dict: "object", list: "list"}.get(kind, kind.__name__)
        raise ValueError(f"{where} is not a JSON {want} (it holds a {type(data).__name__}): it is damaged{fix}")
    return data


def read_json(path, fix: str, kind: type = dict):
    """A JSON file of ours (`read_text`, then `parse_json`): every way it can be damaged is one ValueError naming the
    file and `fix`."""
    return parse_json(read_text(path, fix), path, fix, kind)


def check_loaded(path, info: dict, fix: str, unexpected: bool = False) -> None:
    """Refuse a load that left parameters of the config without weights (transformers would initialise them
    randomly and only log it), with weights of another shape, or (`unexpected`) with weights the config has no
    parameter for."""
    missing = list(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    extra = sorted(info.get("unexpected_keys") or []) if unexpected else []
    if missing or mismatched or extra:
        parts = []
        if extra:
            parts.append(f"weights for {len(extra)} tensor(s) its config has no parameter for ({', '.join(extra[:4])}"
                         f"{', ...' if len(extra) > 4 else ''})")
        if missing:
            parts.append(f"{len(missing)} parameter(s) of its config have no weights ({', '.join(sorted(missing)[:4])}"
                         f"{', ...' if len(missing) > 4 else ''})")
        if mismatched:
            names = [m[0] if isinstance(m, (tuple, list)) else m for m in mismatched]
            parts.append(f"weights of another shape for {names[:4]}")
        raise ValueError(f"{path}: the weights do not match its config.json: {'; '.join(parts)}. The directory is "
                         f"incomplete or mixes two models; {fix}")


def check_tokenizer_fits(path, model, tokenizer, fix: str) -> None:
    """Every id the tokenizer can give must be a row of the model's embedding: a larger id would fail deep inside
    torch (an index error) at the first batch that holds it, or silently read past the table on a GPU."""
    if tokenizer is None:
        return
    rows = model.get_input_embeddings().num_embeddings
    top = max(tokenizer.get_vocab().values(), default=-1)
    if top >= rows:
        raise ValueError(f"{path}: the tokenizer gives ids up to {top}, but the model's embedding has {rows} rows "
                         f"(config.json vocab_size {model.config.get_text_config().vocab_size}): the tokenizer files "
                         f"belong to another model; {fix}")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha1 of the vocabulary, the eos id and the encoding of a probe text: what a tokenizer computes, whatever files
    hold it (token shards and a converted model record it)."""
    vocab = sorted(tokenizer.get_vocab().items())
    probe = tokenizer("def f(x):\n    return 'héllo' + x  # 123", add_special_tokens=False)["input_ids"]
    return hashlib.sha1(json.dumps([vocab, tokenizer.eos_token_id, probe]).encode()).hexdigest()


def check_tokenizer_recorded(path, tokenizer, config, fix: str) -> None:
    """A converted model records its tokenizer in its config (`tokenizer_fingerprint`, which a distilled copy keeps);
    tokenizer files replaced since by another of the same size would give other ids to the same text and every figure
    read through them."""
    want = getattr(config, "tokenizer_fingerprint", None)
    if tokenizer is not None and isinstance(want, str) and tokenizer_fingerprint(tokenizer) != want:
        raise ValueError(f"{path}: its tokenizer files are not the tokenizer it was converted with (its config "
                         f"records another vocabulary or encoding); {fix}")


def check_report(path, config) -> None:
    """A convert output's report.json must describe the model its config.json describes (and be a report at all)."""
    report = Path(path) / REPORT
    if not hasattr(config, "layer_types"):
        return
    if not report.exists():
        check_mixer_block(path, {})
        return
    rep = read_json(report, "convert again into a new --out", object)
    name = getattr(config, "mixer", "gdn")
    args = rep.get("args") if isinstance(rep, dict) else None
    if not isinstance(rep, dict) or not isinstance(rep.get("layer_types", []), list) or \
            not isinstance(args or {}, dict) or not isinstance((args or {}).get(name) or {}, dict):
        raise ValueError(f"{report} is not a conversion report (a JSON object with layer_types and args); it is "
                         "damaged: convert again into a new --out")
    check_mixer_block(path, rep)
    if "layer_types" in rep and list(rep["layer_types"]) != list(config.layer_types or []):
        raise ValueError(f"{path}: report.json and config.json describe different models (layer_types "
                         f"{rep['layer_types']} vs {list(config.layer_types or [])}); the directory mixes two "
                         "conversions: convert again into a new --out")
    reported, stored = (args or {}).get(name), getattr(config, name, None)
    if reported is not None and stored is not None and dict(reported) != dict(stored):
        raise ValueError(f"{path}: report.json and config.json give different {name} options ({reported} vs "
                         f"{stored}); the directory mixes two conversions: convert again into a new --out")


def check_mixer_block(path, rep: dict) -> None:
    """A hybrid's config.json must give every option of its mixer: a missing one would silently take today's
    default, which need not be what the layer was converted and trained with."""
    from taylor_calibrate.model.mixers import get_spec

    try:
        cfg = read_json(Path(path) / "config.json", "")
    except (OSError, ValueError):
        return  # the loader reports it
    if not isinstance(cfg, dict) or cfg.get("model_type") != "taylor_hybrid":
        return
    name = cfg.get("mixer", "gdn")
    block = cfg.get(name) if isinstance(cfg.get(name), dict) else {}
    missing = sorted({f.name for f in dataclasses.fields(get_spec(name).config)} - set(block))
    if missing:
        known = (rep.get("args") or {}).get(name)
        fix = (f"add them back from report.json's args.{name}: \"{name}\": {json.dumps(known)}" if known else
               "convert again into a new --out")
        raise ValueError(f"{Path(path) / 'config.json'} does not give the {name} option(s) {missing} the hybrid was "
                         f"converted with (defaults would be used silently); {fix}")
