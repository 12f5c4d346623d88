"""The `export` command: a converted hybrid -> a format that inference engines run without our package.

qwen3_5.py: transformers' Qwen3.5 (also vLLM, SGLang); gguf.py: llama.cpp's `qwen35` GGUF, from the Qwen3.5 form.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from taylor_calibrate.checkpoint import as_umask, write_errors
from taylor_calibrate.checks import writes_out
from taylor_calibrate.config import ExportArgs
from taylor_calibrate.model.hybrid_config import HEADWISE_TYPES
from taylor_calibrate.export.gguf import export_gguf
from taylor_calibrate.export.qwen3_5 import check_model_dir, export_qwen3_5


def check_whole_layers(model: str) -> None:
    """A Qwen3.5 layer is attention or GDN: a head-wise hybrid (`--policy heads`) has no exact form there."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        types = list(cfg.get("layer_types") or [])
    except (OSError, ValueError, AttributeError, TypeError):
        return  # the exporter names what is wrong with the directory
    headwise = [i for i, t in enumerate(types) if t in HEADWISE_TYPES.values()]
    if headwise:
        raise ValueError(f"{model} is a head-wise hybrid (layers {headwise} keep some attention heads and convert the "
                         "others), which Qwen3.5 cannot express (a layer there is attention or GDN as a whole); "
                         "convert with a layer policy and --target qwen3_5 to export")


def serving_hint(fmt: str, out) -> str:
    """How to serve the export, with the engine settings our measurements chose (docs/serving.md has them)."""
    model = shlex.quote(str(out))  # the GGUF file, or the Qwen3.5 directory
    if fmt == "gguf":
        return (f"  serve: llama-server -m {model} -fa on -np N --no-kv-unified -c N*CONTEXT (each sequence its own "
                "cache cells: llama.cpp builds every step's attention mask over all cells of a unified cache)")
    return (f"  serve: vllm serve {model} --max-model-len CONTEXT, keeping vLLM's default compilation (torch.compile and "
            "CUDA graphs: without them the hybrid's GDN layers decode slower than its teacher; no --enforce-eager, "
            "no -O0). vLLM releases without a text-only Qwen3.5 class need it registered: docs/serving.md")


@writes_out("export")
def run_export(args: ExportArgs) -> dict:
    """Export a converted hybrid to a format that inference engines run without our package."""
    check_model_dir(Path(args.model))  # before anything reads its files (a pipe would block the reader)
    check_whole_layers(args.model)
    with write_errors(args.out):
        out = (export_gguf(args.model, args.out, ftype=args.gguf_type) if args.format == "gguf"
               else export_qwen3_5(args.model, args.out))
    as_umask(args.out)  # written by mkdtemp and safetensors (0700 / 0600)
    if args.format == "gguf":
        print(f"exported {args.model} -> {out} (GGUF {args.gguf_type}, llama.cpp architecture qwen35)")
    else:
        print(f"exported {args.model} -> {out} ({args.format}): load with transformers' AutoModelForCausalLM, no "
              "trust_remote_code")
    print(serving_hint(args.format, out))
    return {"model": args.model, "out": str(out), "format": args.format, "gguf_type": args.gguf_type}
