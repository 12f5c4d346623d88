"""Export: save a hybrid (safetensors + config + tokenizer + report.json) and load it back with clear errors."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPORT = "report.json"


def save_hybrid(model, tokenizer, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def load_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """Load a saved hybrid (or any causal LM directory) and its tokenizer; corrupt or partial directories get an
    error that names the file and the fix instead of a stack trace from the loader."""
    import taylor_calibrate  # noqa: F401  registers the hybrid with the Auto* factories

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json); pass the output of `convert`")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{path} has no *.safetensors weights; re-run `convert` to write them")
    from safetensors import safe_open

    for w in weights:
        try:
            with safe_open(str(w), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise ValueError(f"checkpoint file {w} is corrupt or truncated ({e}); re-run `convert` to rewrite it") from e
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"could not load the model in {path}: {e}") from e
    tokenizer = AutoTokenizer.from_pretrained(path) if any(path.glob("tokenizer*")) else None
    return model.to(device).eval(), tokenizer
