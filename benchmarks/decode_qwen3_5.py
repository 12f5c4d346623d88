"""Decode throughput of an exported hybrid in transformers' own Qwen3_5ForCausalLM, beside its teacher and our own class.

A teacher of a public shape (random weights: speed does not depend on them) is converted with `--target qwen3_5`'s
layer form (uniform policy, keep_every 4, copy-only mixers), exported (`export --format qwen3_5`) and loaded back
with transformers' class. All three models decode through the same static-cache path as benchmarks/perf_decode.py's decode
part (StaticCache, one step captured as a CUDA graph on a GPU; GDN kernels as each class picks them: fla for ours
with backend auto, transformers' own choice for Qwen3_5ForCausalLM), over a context x batch grid, beside each cell's
bandwidth roofline (minimum bytes moved per step). Before timing, the exported model's logits are compared with our
class's, and each model's static decode with its own eager decode.

    python benchmarks/decode_qwen3_5.py --out benchmarks/results/performance/decode_qwen3_5_h200.json     # GPU, one command
    python benchmarks/decode_qwen3_5.py --tiny --device cpu --out /tmp/decode_tiny.json       # checks the script
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from taylor_calibrate.config import GDNConfig
from taylor_calibrate.checkpoint import save_hybrid
from taylor_calibrate.results import environment, record
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.policy import gdn_layers, kept_layers
from taylor_calibrate.export.qwen3_5 import export_qwen3_5, qwen3_form, target_gdn
from taylor_calibrate.teacher import resolve_device


def _perf():
    """perf_common.py and perf_decode.py beside this script, as one namespace: their static-cache decoder, roofline
    and timing helpers (one copy of each)."""
    here = str(Path(__file__).parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import perf_common
    import perf_decode

    return SimpleNamespace(**{**vars(perf_common), **vars(perf_decode)})


@torch.inference_mode()
def models(perf, shape: str, tiny: bool, device, dtype, workdir: Path):
    """teacher, our hybrid (its Qwen3.5 form) and that hybrid exported and loaded with transformers' class."""
    teacher = perf.build_teacher(shape, tiny, device, dtype)
    n = teacher.config.num_hidden_layers
    converted = gdn_layers(kept_layers("uniform", n, 4), n)
    gdn = GDNConfig()
    target_gdn(gdn, teacher.config)
    ours = convert_teacher(qwen3_form(teacher), converted, gdn)
    backend = ours.set_backend("auto")
    save_hybrid(ours, None, workdir / "hybrid")
    export_qwen3_5(workdir / "hybrid", workdir / "qwen3_5")
    served = AutoModelForCausalLM.from_pretrained(workdir / "qwen3_5", dtype=dtype, attn_implementation="sdpa")
    served = served.to(device).eval().requires_grad_(False)
    return {"teacher": teacher, "qwen3_5": served, "ours": ours}, backend, converted


@torch.inference_mode()
def export_error(served, ours, vocab, device, T: int = 64) -> float:
    """max |logits(exported, transformers' class) - logits(ours)| / max |logits(ours)| on one random row."""
    ids = torch.randint(0, vocab, (1, T), device=device)
    a, b = served(ids).logits.float(), ours(ids, use_cache=False).logits.float()
    return ((a - b).abs().max() / b.abs().max()).item()


def table(res: dict) -> str:
    names = list(res["models"])
    head = "| context x batch | " + " | ".join(f"{n} tok/s" for n in names) + \
           " | qwen3_5 / teacher | ours / teacher | roofline qwen3_5 / teacher |"
    lines = [head, "|" + "---|" * (len(names) + 4)]
    for cell, rows in res["rows"].items():
        tok = [rows[n].get("decode_tok_s") for n in names]
        lines.append(f"| {cell} | " + " | ".join("-" if t is None else f"{t:.0f}" for t in tok) +
                     f" | {fmt(rows.get('qwen3_5_speedup'))} | {fmt(rows.get('ours_speedup'))} | "
                     f"{fmt(rows.get('roofline_speedup'))} |")
    return "\n".join(lines)


def fmt(x):
    return "-" if x is None else f"{x:.2f}x"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="1p5b", help="teacher shape of benchmarks/perf_scale.py (1p5b: Qwen2.5-1.5B, 8b: "
                                                     "Qwen3-8B, smollm2)")
    ap.add_argument("--grid", default=None, help="context x batch cells, e.g. 4096x1,4096x8,65536x8")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per cell")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="sequences prefilled at a time")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and contexts (CPU is fine): checks the script")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="JSON path (a .md table is written beside it)")
    a = ap.parse_args(argv)
    perf = _perf()
    device = resolve_device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    grid = a.grid or ("32x1,32x2" if a.tiny else "4096x1,4096x8,16384x8,32768x1,32768x8,65536x1,65536x8")
    steps = a.steps or (3 if a.tiny else 64)
    chunk = a.prefill_chunk or (2 if a.tiny else 8)
    res = {"command": "python benchmarks/decode_qwen3_5.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "env": environment(), "shape": a.shape + (" (tiny)" * a.tiny),
           "dtype": str(dtype).removeprefix("torch."), "steps": steps, "graph": device.type == "cuda", "rows": {}}

    def save():
        if a.out:
            res.update(record(a.out, res, a, command=res["command"]))
            Path(a.out).with_suffix(".md").write_text(table(res) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        ms, backend, converted = models(perf, a.shape, a.tiny, device, dtype, Path(tmp))
        vocab = ms["teacher"].config.vocab_size
        res.update(models={k: type(m).__name__ for k, m in ms.items()}, gdn_backend_ours=backend,
                   gdn_layers=converted, kept_layers=ms["teacher"].config.num_hidden_layers - len(converted))
        res["export_logits_rel_err"] = export_error(ms["qwen3_5"], ms["ours"], vocab, device)
        res["static_decode_rel_err"] = {}
        for n, m in ms.items():
            try:
                res["static_decode_rel_err"][n] = perf.static_decode_error(m, 32 if a.tiny else 1024, 8, vocab, device)
            except RuntimeError as e:  # e.g. a graph capture this class does not survive: recorded, timing goes on
                res["static_decode_rel_err"][n] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        print(f"[decode_qwen3_5] export logits rel err {res['export_logits_rel_err']:.2e}; static vs eager "
              f"{json.dumps(res['static_decode_rel_err'])}", flush=True)
        save()
        for cell in grid.split(","):
            ctx, B = (int(x) for x in cell.split("x"))
            rows = {}
            for name, m in ms.items():
                try:
                    rows[name] = perf.graph_decode_row(m, B, ctx, steps, vocab, device, chunk)
                except RuntimeError as e:  # out of memory at the largest cells: recorded, the run goes on
                    rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
                perf.free(device)
            t = rows["teacher"]
            for name in ("qwen3_5", "ours"):
                rows[f"{name}_speedup"] = perf.ratio(t.get("decode_s"), rows[name].get("decode_s"))
            rows["roofline_speedup"] = perf.ratio(t.get("min_bytes_per_step"), rows["qwen3_5"].get("min_bytes_per_step"))
            res["rows"][cell] = rows
            print(f"[decode_qwen3_5] {cell}: " + json.dumps(rows), flush=True)
            save()
    print(json.dumps(res, indent=2, default=str))
    print(table(res))
    return res


if __name__ == "__main__":
    main()
