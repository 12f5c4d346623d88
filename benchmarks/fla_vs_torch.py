"""fla kernels vs the torch reference on a whole hybrid (GPU): same logits within a principled tolerance.

Tolerance (flash-attention's test rule): against an fp32 torch-reference run, the bf16 fla run's error must be
at most 2x the error of a bf16 torch-reference run (+1e-3 absolute slack on the relative RMS). Prints JSON + a table.

    python benchmarks/fla_vs_torch.py --teacher smollm2-135m --out results.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from taylor_calibrate import GDNConfig, convert_teacher
from taylor_calibrate.config import CorpusSpec
from taylor_calibrate.data import load_splits
from taylor_calibrate.results import record
from taylor_calibrate.policy import gdn_layers, kept_layers
from taylor_calibrate.teacher import load_teacher


def rel_rms(a, b):
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


@torch.no_grad()
def logits(model, ids, backend):
    model.set_backend(backend)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model(input_ids=ids, use_cache=False).logits.float()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    teacher = load_teacher(a.teacher, "cuda", torch.float32)
    ids = load_splits(CorpusSpec(), teacher.tokenizer, a.seq_len, 1, a.batch).heldout.cuda()
    n = teacher.model.config.num_hidden_layers
    converted = gdn_layers(kept_layers("uniform", n, 4), n)
    hybrid32 = convert_teacher(teacher.model, converted, GDNConfig())
    ref, _ = logits(hybrid32, ids, "torch")
    hybrid16 = convert_teacher(teacher.model.to(torch.bfloat16), converted, GDNConfig())
    torch_bf16, t_torch = logits(hybrid16, ids, "torch")
    fla_bf16, _ = logits(hybrid16, ids, "fla")  # warm-up compiles the kernels
    fla_bf16, t_fla = logits(hybrid16, ids, "fla")
    _, t_torch = logits(hybrid16, ids, "torch")
    err_torch, err_fla = rel_rms(torch_bf16, ref), rel_rms(fla_bf16, ref)
    result = {
        "teacher": a.teacher, "tokens": ids.numel(), "gdn_layers": len(converted),
        "rel_rms_err_torch_bf16": err_torch, "rel_rms_err_fla_bf16": err_fla,
        "tolerance": 2 * err_torch + 1e-3, "pass": err_fla <= 2 * err_torch + 1e-3,
        "top1_agreement_fla_vs_fp32": (fla_bf16.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "forward_s_torch_bf16": t_torch, "forward_s_fla_bf16": t_fla,
        "device": torch.cuda.get_device_name(), "command": "python benchmarks/fla_vs_torch.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out" and v is not None),
    }
    print(json.dumps(result, indent=2))
    print(f"| run | rel. RMS error vs fp32 torch | forward s |\n|---|---|---|\n"
          f"| torch reference, bf16 | {err_torch:.2e} | {t_torch:.3f} |\n| fla kernels, bf16 | {err_fla:.2e} | {t_fla:.3f} |")
    if a.out:
        record(a.out, result, a, command=result["command"])


if __name__ == "__main__":
    main()
