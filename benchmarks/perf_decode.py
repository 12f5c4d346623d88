"""The 1.5B-shape teacher and its uniform hybrid decoding through a StaticCache with one step captured as a CUDA
graph (on a GPU), over a context x batch grid (--decode-grid), beside the bandwidth roofline of each cell; the
logits are first checked against the eager decode.

    python benchmarks/perf_decode.py --out perf_decode.json
    python benchmarks/perf_decode.py --tiny --device cpu --out /tmp/perf_decode.json
"""
from __future__ import annotations

import contextlib
import dataclasses
import json

import torch

# perf_common.py sits beside this script (its directory is on sys.path when it runs)
from perf_common import cache_bytes, free, inference_models, kv_bytes, mb, measure, ratio, run_benchmark, tensor_bytes

DEFAULTS = {
    "decode_grid": ("4096x8,16384x8,32768x1,32768x8,32768x16,32768x32,32768x64,65536x8", "32x1,32x3"),
    "graph_steps": (64, 3),
    "prefill_chunk": (8, 2),
}
"""Flag defaults: (full, --tiny)."""


@torch.inference_mode()
def prefilled_static_cache(model, ids, max_len: int, chunk: int):
    """A transformers StaticCache (fixed-address KV buffers, recurrent / conv states) holding the prefill of `ids`
    (B, T), prefilled `chunk` sequences at a time through the model's DynamicCache and copied in: a big batch's
    one-shot prefill would not fit beside the static buffers. Returns (cache, each sequence's next greedy token)."""
    from transformers import StaticCache

    B, T = ids.shape
    static = StaticCache(config=model.config, max_cache_len=max_len)
    nxt = []
    for b0 in range(0, B, chunk):
        rows = slice(b0, b0 + chunk)
        out = model(input_ids=ids[rows], use_cache=True, logits_to_keep=1)
        nxt.append(out.logits[:, -1:].argmax(-1))
        for src, dst in zip(out.cache.layers, static.layers):
            if hasattr(dst, "recurrent_states"):  # a GDN layer: recurrent (and conv) states, no KV
                for kind in ("recurrent", "conv"):
                    for i, s in getattr(src, f"{kind}_states").items():
                        if s is None:
                            continue
                        if not getattr(dst, f"is_{kind}_states_initialized")[i]:
                            dst.lazy_initialization(**{f"{kind}_states": s.new_zeros(B, *s.shape[1:])}, state_idx=i)
                        getattr(dst, f"{kind}_states")[i][rows].copy_(s)
                        if kind == "conv":
                            dst.has_previous_state[i] = True
            else:
                if not dst.is_initialized:
                    dst.lazy_initialization(src.keys.new_empty(B, *src.keys.shape[1:]),
                                            src.values.new_empty(B, *src.values.shape[1:]))
                dst.keys[rows, :, :T].copy_(src.keys)
                dst.values[rows, :, :T].copy_(src.values)
                dst.cumulative_length.fill_(T)
        del out
    return static, torch.cat(nxt)


@dataclasses.dataclass
class StaticDecoder:
    step: object  # () -> None: one greedy token for every sequence (a CUDA graph's replay on a GPU)
    tok: torch.Tensor  # (B, 1) the next input token; each step overwrites it with its argmax
    pos: torch.Tensor  # (1,) the next position
    logits: torch.Tensor  # (B, V) the last step's logits


def static_decoder(model, cache, tok, ctx: int, device, graph: bool) -> StaticDecoder:
    """Greedy decoding through a StaticCache as a function of fixed-address buffers only (token, position, cache),
    so that on a GPU one step is captured in a CUDA graph and replayed per token: no Python, no kernel launches, no
    allocator in the timed loop, for teacher and hybrid alike. The mask is the explicit 4-D one (keys up to the
    position), which transformers hands to SDPA as it is. Capturing runs GRAPH_WARMUP untimed steps first."""
    B = tok.shape[0]
    max_len = static_max_len(cache)
    keys = torch.arange(max_len, device=device)
    dec = StaticDecoder(step=None, tok=tok.clone(), pos=torch.full((1,), ctx, device=device, dtype=torch.long),
                        logits=None)

    def step():
        mask = (keys <= dec.pos).view(1, 1, 1, max_len).expand(B, 1, 1, max_len)
        out = model(input_ids=dec.tok, attention_mask=mask, position_ids=dec.pos.view(1, 1).expand(B, 1),
                    cache=cache, use_cache=True)
        last = out.logits[:, -1]
        if dec.logits is None:
            dec.logits = torch.empty_like(last)
        dec.logits.copy_(last)
        dec.tok.copy_(last.argmax(-1, keepdim=True))
        dec.pos.add_(1)

    dec.step = step
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: autotuning, lazy inits, allocator pools
            for _ in range(GRAPH_WARMUP):
                step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        dec.step = g.replay
    return dec


GRAPH_WARMUP = 3


def static_max_len(cache) -> int | None:
    """The KV buffer length of a StaticCache (None when it has no attention layer)."""
    return next((layer.max_cache_len for layer in cache.layers if hasattr(layer, "max_cache_len")), None)


def static_len(ctx: int, steps: int) -> int:
    """Static KV length for ctx + steps (+ the capture's warm-up) tokens, a multiple of 64 (SDPA mask alignment)."""
    return -(-(ctx + steps + GRAPH_WARMUP + 1) // 64) * 64


def step_bytes(model, cache, ctx: int) -> int:
    """HBM bytes one decode step at context `ctx` must move at least: every weight once (a tied embedding once, as
    lm_head), the KV of the first `ctx` positions, and each recurrent / conv state read and written. The decode
    roofline is this / bandwidth."""
    weights = sum(tensor_bytes(p) for p in {id(p): p for p in model.parameters()}.values())
    kv = kv_bytes(cache)
    kv_used = kv * ctx // static_max_len(cache) if kv else 0
    return weights + kv_used + 2 * (cache_bytes(cache) - kv)


@torch.inference_mode()
def graph_decode_row(model, B, ctx, steps, vocab, device, chunk):
    ids = torch.randint(0, vocab, (B, ctx), device=device)
    cache, tok = prefilled_static_cache(model, ids, static_len(ctx, steps), chunk)
    del ids
    moved = step_bytes(model, cache, ctx)
    dec = static_decoder(model, cache, tok, ctx, device, graph=device.type == "cuda")

    def decode():
        for _ in range(steps):
            dec.step()

    _, decode_s, peak = measure(decode, device)
    del cache, dec
    return {"decode_s": decode_s, "decode_ms_per_step": 1e3 * decode_s / steps, "decode_tok_s": B * steps / decode_s,
            "decode_peak_mb": mb(peak), "min_bytes_per_step": moved, "achieved_gb_s": moved * steps / decode_s / 1e9}


@torch.inference_mode()
def static_decode_error(model, ctx, steps, vocab, device) -> dict:
    """Max |logit difference| / max |logit| between the model's own eager decode (DynamicCache, no mask) and the static
    decoder fed the same tokens, without and (on a GPU) with the CUDA graph: a replay that read stale buffers, or a
    wrong mask / position, shows up here. Batch 2, `steps` tokens after a ctx-token prompt."""
    ids = torch.randint(0, vocab, (2, ctx), device=device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    dyn, tok = out.cache, out.logits[:, -1:].argmax(-1)
    fed, ref = [], []
    for _ in range(steps):
        fed.append(tok)
        logits = model(input_ids=tok, cache=dyn, use_cache=True).logits[:, -1]
        ref.append(logits)
        tok = logits.argmax(-1, keepdim=True)
    ref = torch.stack(ref)
    errors = {}
    for graph in (False, True) if device.type == "cuda" else (False,):
        cache, tok0 = prefilled_static_cache(model, ids, static_len(ctx, steps), 2)
        saved = {i: [(states, k, v.clone()) for states in (layer.recurrent_states, layer.conv_states)
                     for k, v in states.items() if v is not None]
                 for i, layer in enumerate(cache.layers) if hasattr(layer, "recurrent_states")}
        dec = static_decoder(model, cache, tok0, ctx, device, graph)
        for i, layer in enumerate(cache.layers):  # rewind what the capture's warm-up decoded (later KV is masked)
            if i in saved:  # recurrent and short-conv states
                for states, k, v in saved[i]:
                    states[k].copy_(v)
            else:
                layer.cumulative_length.fill_(ctx)
        dec.pos.fill_(ctx)
        got = []
        for t in fed:
            dec.tok.copy_(t)
            dec.step()
            got.append(dec.logits.clone())
        errors["graph" if graph else "static"] = ((torch.stack(got) - ref).abs().max() / ref.abs().max()).item()
        del cache, dec
    return errors


def part_decode(a, device, dtype, res, save):
    """Decode with both models graph-captured over static caches (the launch overhead that dominates eager decoding
    at batch 8 gone for both), at the context x batch grid of --decode-grid, beside the bandwidth roofline."""
    teacher, hybrid, gdn_backend, converted = inference_models(a, device, dtype)
    cfg = teacher.config
    models = {"teacher": teacher, "hybrid": hybrid}
    key = "decode" if a.decode_sdpa == "auto" else f"decode_{a.decode_sdpa}"
    detail = res.setdefault(key, {})
    detail.update(shape="qwen2.5-1.5b" + (" (tiny)" if a.tiny else ""), kept_layers=cfg.num_hidden_layers - len(converted),
                  gdn_layers=len(converted), gdn_backend=gdn_backend, teacher_attention="sdpa (explicit mask)",
                  graph=device.type == "cuda", steps=a.graph_steps, prefill_chunk=a.prefill_chunk,
                  sdpa_backend=a.decode_sdpa, rows={})
    with sdpa_restricted(a.decode_sdpa):
        decode_rows(a, device, res, save, models, detail, key)
    del models, teacher, hybrid
    free(device)


def sdpa_restricted(kernel: str):
    """Every SDPA call in the block (CUDA graph captures included) on that one kernel; "auto": PyTorch's choice."""
    if kernel == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, kernel.upper())])


def decode_rows(a, device, res, save, models, detail, key):
    """The logits check, then one row per --decode-grid cell into `detail` (saved after each)."""
    vocab = models["teacher"].config.vocab_size
    detail["logits_rel_err"] = {}
    for name, m in models.items():
        try:
            detail["logits_rel_err"][name] = static_decode_error(m, 64 if a.tiny else 1024, 8, vocab, device)
        except RuntimeError as e:  # e.g. a restricted SDPA kernel that does not take this mask
            detail["logits_rel_err"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    print(f"[decode] static / graph decode vs eager: {json.dumps(detail['logits_rel_err'])}", flush=True)
    save()
    for cell in a.decode_grid.split(","):
        ctx, B = (int(x) for x in cell.split("x"))
        rows = {}
        for name, model in models.items():
            try:
                rows[name] = graph_decode_row(model, B, ctx, a.graph_steps, vocab, device, a.prefill_chunk)
            except RuntimeError as e:  # out of memory, or a restricted SDPA kernel that does not take this mask
                rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            free(device)
        t, h = rows["teacher"], rows["hybrid"]
        rows["decode_speedup"] = ratio(t.get("decode_s"), h.get("decode_s"))
        rows["roofline_speedup"] = ratio(t.get("min_bytes_per_step"), h.get("min_bytes_per_step"))
        detail["rows"][cell] = rows
        if key == "decode":
            res.setdefault("decode_speedup_graph", {}).setdefault(str(ctx), {})[str(B)] = rows["decode_speedup"]
        print(f"[decode] {cell}: " + json.dumps(rows), flush=True)
        save()


def add_arguments(ap):
    ap.add_argument("--decode-sdpa", default="auto", choices=("auto", "efficient_attention", "cudnn_attention", "math"),
                    help="restrict SDPA to one kernel (auto: PyTorch's choice for a masked single query)")


def main(argv=None):
    return run_benchmark("perf_decode", __doc__, part_decode, DEFAULTS, add_arguments, argv)


if __name__ == "__main__":
    main()
