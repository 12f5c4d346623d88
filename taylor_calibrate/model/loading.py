"""Load-time checks of a saved model directory, applied by the hybrid's `from_pretrained` and by export.py's readers:
weights that do not cover the config, or a report.json that describes another model, are refused with the fix.
Imports nothing of ours (the model uses them; checkpoint I/O lives in export.py)."""
from __future__ import annotations

import json
from pathlib import Path

REPORT = "report.json"


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


def check_report(path, config) -> None:
    """A convert output's report.json must describe the model its config.json describes."""
    report = Path(path) / REPORT
    if not report.is_file() or not hasattr(config, "layer_types"):
        return
    try:
        rep = json.loads(report.read_text())
    except ValueError as e:
        raise ValueError(f"{report} is not valid JSON ({e}); convert again into a new --out") from None
    if "layer_types" in rep and list(rep["layer_types"]) != list(config.layer_types or []):
        raise ValueError(f"{path}: report.json and config.json describe different models (layer_types "
                         f"{rep['layer_types']} vs {list(config.layer_types or [])}); the directory mixes two "
                         "conversions: convert again into a new --out")
    name = getattr(config, "mixer", "gdn")
    reported, stored = (rep.get("args") or {}).get(name), getattr(config, name, None)
    if reported is not None and stored is not None and dict(reported) != dict(stored):
        raise ValueError(f"{path}: report.json and config.json give different {name} options ({reported} vs "
                         f"{stored}); the directory mixes two conversions: convert again into a new --out")
