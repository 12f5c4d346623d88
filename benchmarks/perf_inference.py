"""A 1.5B-shape hybrid (uniform, keep_every 4: 7 attention + 21 GDN layers, copy-only mixers: speed does not depend
on the init) against its teacher (SDPA): prefill and decode throughput at long contexts, batch 1 and 8, and cache
bytes per sequence (KV of attention layers + GDN recurrent / conv state); eager decoding through the models'
DynamicCache, as `generate` runs by default. *_speedup = teacher seconds / hybrid seconds (> 1: the hybrid is
faster); cache_bytes_ratio = hybrid bytes / teacher bytes.

    python benchmarks/perf_inference.py --out perf_inference.json
    python benchmarks/perf_inference.py --tiny --device cpu --out /tmp/perf_inference.json
"""
from __future__ import annotations

import json

import torch

# perf_common.py sits beside this script (its directory is on sys.path when it runs)
from perf_common import (cache_bytes, counting_gdn_kernels, free, inference_models, ints, mb, measure, ratio,
                         run_benchmark)

from taylor_calibrate.config import GDNConfig

DEFAULTS = {'contexts': ('4096,16384,32768,65536', '32,64'), 'batches': ('1,8', '1,2'), 'decode_steps': (32, 3)}
"""Flag defaults: (full, --tiny)."""


def step(model, tok, cache):
    out = model(input_ids=tok, cache=cache, use_cache=True)
    return out.logits[:, -1:].argmax(-1)


@torch.inference_mode()  # as `generate` runs: no autograd graph (the hybrid's parameters require grad)
def generation_row(model, B, ctx, steps, vocab, device):
    """Prefill B x ctx tokens (logits of the last token only, as generate does), then `steps` greedy 1-token steps
    through the model's own cache (transformers' DynamicCache from the config's layer_types). Each is timed after an
    untimed run of the same shape."""
    ids = torch.randint(0, vocab, (B, ctx), device=device)
    model(input_ids=ids, use_cache=True, logits_to_keep=1)  # warm-up at this shape (kernels may autotune per shape)
    free(device)
    out, prefill_s, prefill_peak = measure(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), device)
    cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
    del out
    per_seq = cache_bytes(cache) / B
    for _ in range(2):  # first steps at a new batch size may compile / autotune
        tok = step(model, tok, cache)

    def decode():
        nonlocal tok
        for _ in range(steps):
            tok = step(model, tok, cache)

    _, decode_s, decode_peak = measure(decode, device)
    del cache
    return {"prefill_s": prefill_s, "prefill_tok_s": B * ctx / prefill_s, "prefill_peak_mb": mb(prefill_peak),
            "decode_s": decode_s, "decode_ms_per_step": 1e3 * decode_s / steps, "decode_tok_s": B * steps / decode_s,
            "decode_peak_mb": mb(decode_peak), "cache_bytes_per_seq": per_seq}


def analytic_cache_bytes(cfg, n_attn: int, n_gdn: int, ctx: int, kv_bytes: int, gdn: GDNConfig) -> int:
    """Per sequence: K and V (Hkv x D per token) of every attention layer; per GDN layer an fp32 H x D x D state and,
    with short convs, the last K-1 inputs of the q, k and v convs (3 H D channels, model dtype)."""
    D, H = cfg.head_dim, cfg.num_attention_heads
    conv = 0 if gdn.short_conv == "none" else 3 * H * D * (gdn.conv_size - 1) * kv_bytes
    return n_attn * 2 * cfg.num_key_value_heads * D * ctx * kv_bytes + n_gdn * (H * D * D * 4 + conv)


def part_inference(a, device, dtype, res, save):
    teacher, hybrid, gdn_backend, converted = inference_models(a, device, dtype)
    cfg = teacher.config
    n = cfg.num_hidden_layers
    models = {"teacher": teacher, "hybrid": hybrid}
    detail = res.setdefault("inference", {})
    detail.update(shape="qwen2.5-1.5b" + (" (tiny)" if a.tiny else ""), kept_layers=n - len(converted),
                  gdn_layers=len(converted), gdn_backend=gdn_backend, teacher_attention="sdpa",
                  decode_steps=a.decode_steps, rows={})
    kv_bytes = torch.empty((), dtype=dtype).element_size()
    for B in ints(a.batches):
        for ctx in ints(a.contexts):
            rows = {}
            for name, model in models.items():
                try:
                    with counting_gdn_kernels() as counts:
                        rows[name] = generation_row(model, B, ctx, a.decode_steps, cfg.vocab_size, device)
                    if name == "hybrid":
                        rows[name]["gdn_kernel_calls"] = dict(counts)
                except torch.OutOfMemoryError as e:
                    rows[name] = {"error": f"OOM: {str(e).splitlines()[0]}"}
                free(device)
            rows["teacher_cache_bytes_analytic"] = analytic_cache_bytes(cfg, n, 0, ctx, kv_bytes, GDNConfig())
            rows["hybrid_cache_bytes_analytic"] = analytic_cache_bytes(cfg, n - len(converted), len(converted), ctx,
                                                                       kv_bytes, GDNConfig())
            t, h = rows["teacher"], rows["hybrid"]
            rows["prefill_speedup"] = ratio(t.get("prefill_s"), h.get("prefill_s"))
            rows["decode_speedup"] = ratio(t.get("decode_s"), h.get("decode_s"))
            rows["cache_bytes_ratio"] = ratio(h.get("cache_bytes_per_seq"), t.get("cache_bytes_per_seq"))
            detail["rows"][f"{ctx}x{B}"] = rows
            for key in ("prefill_speedup", "decode_speedup"):
                res.setdefault(key, {}).setdefault(str(ctx), {})[str(B)] = rows[key]
            if rows["cache_bytes_ratio"] is not None and (B == 1 or str(ctx) not in res.get("cache_bytes_ratio", {})):
                res.setdefault("cache_bytes_ratio", {})[str(ctx)] = rows["cache_bytes_ratio"]
            print(f"[inference] ctx={ctx} batch={B}: " + json.dumps(rows), flush=True)
            save()
    del models, teacher, hybrid
    free(device)


def main(argv=None):
    return run_benchmark("perf_inference", __doc__, part_inference, DEFAULTS, None, argv)


if __name__ == "__main__":
    main()
