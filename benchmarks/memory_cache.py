"""Cache bytes per sequence of a real teacher and of a hybrid of it: counted (taylor_calibrate/memory.py) at several
lengths, per layer type, and checked against the tensors transformers' cache allocates in a prefill of
--measure_length tokens (the teacher, and a hybrid that converts --gdn_layers with copy-only GDN mixers: the cache's
shapes do not depend on the weights). Also: what --kv_budget a hybrid keeping one full-attention layer needs, and the
layers the byte budget keeps at --budget. CPU is enough (one prefill each). Prints JSON.

    bash scripts/gemma3.sh && python benchmarks/memory_cache.py --teacher models/gemma-3-270m-q4_k_m.gguf \
        --out benchmarks/results/memory_gemma3.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from taylor_calibrate.model.hybrid_config import cached_layer_types
from taylor_calibrate.model.mixers.gdn.config import GDNConfig
from taylor_calibrate.memory import (byte_budget, cache_report, hybrid_layer_bytes,
                                     measured_cache_bytes, teacher_layer_bytes)
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.policy import kept_layers
from taylor_calibrate.results import record
from taylor_calibrate.teacher import load_teacher


def prefill_bytes(model, length: int) -> tuple[int, float]:
    ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    return measured_cache_bytes(cache), time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default="smollm2-135m")
    ap.add_argument("--lengths", default="4096,8192,32768")
    ap.add_argument("--measure_length", type=int, default=8192)
    ap.add_argument("--gdn_layers", default=None, help="comma list; default: every full-attention layer but the last "
                    "(every layer but the last, for a teacher without windows)")
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    teacher = load_teacher(a.teacher, torch.device("cpu"), torch.float32).model
    cfg = teacher.config
    types = cached_layer_types(cfg)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    gdn = ([int(x) for x in a.gdn_layers.split(",")] if a.gdn_layers
           else full[:-1] if len(full) < len(types) else list(range(len(types) - 1)))
    lengths = [int(x) for x in a.lengths.split(",")]
    counted = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        per_layer = {n: teacher_layer_bytes(cfg, n, dtype) for n in lengths}
        counted[name] = {"teacher_by_type": {str(n): {t: sum(b for b, u in zip(per_layer[n], types) if u == t)
                                                      for t in dict.fromkeys(types)} for n in lengths},
                         "teacher": {str(n): sum(per_layer[n]) for n in lengths}}
        counted[name]["one_full_layer_budget"] = {}
        for n in lengths:  # the least --kv_budget that keeps one full-attention layer (and every cheaper window)
            b = byte_budget(cfg, GDNConfig(), 0.5, n, dtype)
            costs = b.layer_costs()
            need = max(costs[full[-1]]) + sum(min(c) for i, c in costs.items() if i != full[-1])
            counted[name]["one_full_layer_budget"][str(n)] = need / b.teacher
            scores = [1.0 if i in full else 0.0 for i in range(len(types))]  # global layers ranked first
            try:
                kept = kept_layers("retrieval", len(types), 4, scores, kv_budget=byte_budget(cfg, GDNConfig(),
                                                                                             a.budget, n, dtype))
            except ValueError as e:
                kept = str(e)
            counted[name].setdefault("kept_at_budget", {})[str(n)] = kept
    hybrid = convert_teacher(teacher, gdn, GDNConfig(), teacher_name=a.teacher)
    L = a.measure_length
    t_meas, t_s = prefill_bytes(teacher, L)
    h_meas, h_s = prefill_bytes(hybrid, L)
    t_count = sum(teacher_layer_bytes(cfg, L, torch.float32))
    h_count = sum(hybrid_layer_bytes(hybrid.config, L, torch.float32))
    result = {
        "teacher": a.teacher, "layers": len(types), "layer_types": types,
        "sliding_window": getattr(cfg, "sliding_window", None), "num_key_value_heads": cfg.num_key_value_heads,
        "num_attention_heads": cfg.num_attention_heads, "head_dim": getattr(cfg, "head_dim", None),
        "counted": counted,
        "measured": {"length": L, "dtype": "float32", "hybrid_gdn_layers": gdn,
                     "teacher": {"allocated": t_meas, "counted": t_count, "ratio": t_meas / t_count},
                     "hybrid": {"allocated": h_meas, "counted": h_count, "ratio": h_meas / h_count},
                     "fraction_allocated": h_meas / t_meas, "fraction_counted": h_count / t_count,
                     "prefill_s": {"teacher": t_s, "hybrid": h_s}},
        "report_at_measure_length": cache_report(cfg, hybrid.config, L, torch.float32),
    }
    if a.out:
        result = record(a.out, result, a)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
