"""Cache memory per sequence, in bytes, at a context length: what a teacher and a hybrid hold while decoding, and the
byte budget (--kv_budget F at --context L) that the layer policies spend.

Each layer is counted as it caches:
- softmax attention: positions x KV heads x head_dim x 2 (K and V) x the dtype's bytes, where a sliding-window layer
  holds at most its window of positions (Gemma 3's `sliding_attention` layers, every layer of a Mistral with
  `sliding_window`, Qwen2's layers from `max_window_layers` on when `use_sliding_window`; transformers' own
  `layer_types` rule, which its DynamicCache follows);
- a GDN layer (docs/method.md, "The GDN layer"): fixed bytes whatever the length, its recurrent state (GDN heads x
  head_dim x head_dim, kept in fp32 by fla's kernels and by our torch path) and, with a short conv, the conv's last
  conv_size - 1 inputs of its q, k and v channels (3 x GDN heads x head_dim, in the model dtype);
- a head-wise layer: the KV of its kept groups plus the GDN state of the other groups' query heads.
The GDN layer shape is the hybrid's contract (config.HybridConfig): GDN heads = the query heads of the converted KV
groups, head_dim = the teacher's, options from the config's `gdn` dict; read from there, not from the mixer module.
A sliding layer is counted at its full window (as a static cache holds it; transformers' DynamicCache keeps one
position fewer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from taylor_calibrate.model.hybrid_config import HEADWISE_TYPES, MIXER_TYPE, cached_layer_types
from taylor_calibrate.model.mixers import get_spec, spec_for_options

CONTEXT_CAP = 32768
"""Default --context: the teacher's max_position_embeddings, at most this."""
REPORT_LENGTHS = (4096, 32768, 131072)
"""Lengths at which convert prints the cache bytes (those up to --context, and --context itself)."""
SLIDING_TYPES = ("sliding_attention", "hybrid_sliding")
MOST = 0.5
"""Windows "bound most" of a teacher's cache when they save more than this share of its full-attention bytes."""


def default_context(config, context: int | None = None) -> int:
    """`context` (tokens) when given, else the teacher's max_position_embeddings capped at CONTEXT_CAP."""
    if context is not None:
        if context < 1:
            raise ValueError(f"--context {context} must be >= 1 (tokens at which the KV cache is counted)")
        return int(context)
    return int(min(getattr(config, "max_position_embeddings", None) or CONTEXT_CAP, CONTEXT_CAP))


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype (or its name: "bfloat16", "float32", ...)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    return torch.empty((), dtype=dtype).element_size()


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_bytes(config, layer_type: str, kv_heads: int, context: int, dtype) -> int:
    """KV cache bytes of `kv_heads` KV heads of one layer after `context` tokens."""
    positions = context
    if layer_type in SLIDING_TYPES and getattr(config, "sliding_window", None):
        positions = min(context, int(config.sliding_window))
    return positions * kv_heads * head_dim(config) * 2 * dtype_bytes(dtype)


def state_bytes(options, heads: int, dim: int, dtype) -> int:
    """Fixed bytes per sequence of `heads` mixer heads of head_dim `dim` in one layer, as the mixer's spec counts them
    (`options`: the mixer's options dataclass)."""
    return spec_for_options(options).state_bytes(options, heads, dim, dtype_bytes(dtype))


def mixer_options(hybrid_config):
    """The options dataclass of a hybrid config's mixer."""
    spec = get_spec(hybrid_config.mixer)
    return spec.options(hybrid_config.mixer_options)


def teacher_layer_bytes(config, context: int, dtype) -> list[int]:
    """Cache bytes of each teacher layer after `context` tokens."""
    kv = config.num_key_value_heads
    return [attention_bytes(config, t, kv, context, dtype) for t in cached_layer_types(config)]


def hybrid_layer_bytes(config, context: int, dtype) -> list[int]:
    """Cache bytes of each layer of a hybrid (a HybridConfig: layer_types, attention_heads, gdn) after `context`
    tokens."""
    kv, per = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads
    options, out = mixer_options(config), []
    for i, t in enumerate(cached_layer_types(config)):
        if t == MIXER_TYPE:
            out.append(state_bytes(options, config.num_attention_heads, head_dim(config), dtype))
        elif t in HEADWISE_TYPES.values():
            kept = len(config.kept_groups(i))
            out.append(attention_bytes(config, t, kept, context, dtype)
                       + state_bytes(options, (kv - kept) * per, head_dim(config), dtype))
        else:
            out.append(attention_bytes(config, t, kv, context, dtype))
    return out


@dataclass(frozen=True)
class ByteBudget:
    """--kv_budget F as bytes: F x the teacher's cache bytes at `context`, and what one KV group of each layer costs
    kept as attention (`group_kv`) or converted to GDN heads (`group_gdn`); a layer is `groups` of them."""

    fraction: float
    context: int
    teacher: int
    group_kv: list[int]
    group_gdn: list[int]
    groups: int

    @property
    def limit(self) -> float:
        return self.fraction * self.teacher

    def layer_costs(self) -> dict[int, tuple[int, int]]:
        """{layer: (bytes kept as attention, bytes converted to GDN)}."""
        return {i: (self.groups * a, self.groups * g) for i, (a, g) in enumerate(zip(self.group_kv, self.group_gdn))}

    def group_costs(self) -> dict[tuple[int, int], tuple[int, int]]:
        """{(layer, KV group): (bytes kept as attention, bytes converted to GDN)}."""
        return {(i, g): (a, c) for i, (a, c) in enumerate(zip(self.group_kv, self.group_gdn))
                for g in range(self.groups)}


def byte_budget(teacher_config, gdn, fraction: float | None, context: int | None, dtype) -> ByteBudget | None:
    """The budget of --kv_budget `fraction` at --context `context` (None: default_context); None without a
    fraction (the policies then keep one unit in --keep_every)."""
    if fraction is None:
        return None
    if not 0 < fraction < 1:
        raise ValueError(f"kv_budget={fraction} must be a fraction of the teacher's KV cache bytes in (0, 1)")
    L = default_context(teacher_config, context)
    cfg, kv = teacher_config, teacher_config.num_key_value_heads
    per = cfg.num_attention_heads // kv
    return ByteBudget(fraction=fraction, context=L, teacher=sum(teacher_layer_bytes(cfg, L, dtype)),
                      group_kv=[attention_bytes(cfg, t, 1, L, dtype) for t in cached_layer_types(cfg)],
                      group_gdn=[state_bytes(gdn, per, head_dim(cfg), dtype)] * cfg.num_hidden_layers, groups=kv)


def report_lengths(context: int) -> list[int]:
    """REPORT_LENGTHS up to `context`, and `context`."""
    return sorted({n for n in REPORT_LENGTHS if n <= context} | {context})


def cache_report(teacher_config, hybrid_config, context: int, dtype) -> dict:
    """report.json's memory keys: `context`; `kv_bytes` {teacher, hybrid: {length: bytes per sequence}} at
    report_lengths(context); `kv_fraction` = hybrid / teacher bytes at `context`; and, at `context`, the teacher's
    bytes by layer type, the share its windows already save against full attention in every layer
    (`window_saving`), the least any hybrid of it caches (`floor_fraction`: each layer in its cheaper form, GDN or
    attention) and what keeping one full-attention layer costs (`full_layer_fraction`)."""
    lengths = report_lengths(context)
    teacher = {str(n): sum(teacher_layer_bytes(teacher_config, n, dtype)) for n in lengths}
    hybrid = {str(n): sum(hybrid_layer_bytes(hybrid_config, n, dtype)) for n in lengths}
    layers = teacher_layer_bytes(teacher_config, context, dtype)
    types = cached_layer_types(teacher_config)
    by_type = {t: sum(b for b, u in zip(layers, types) if u == t) for t in dict.fromkeys(types)}
    kv = teacher_config.num_key_value_heads
    full = attention_bytes(teacher_config, "full_attention", kv, context, dtype)
    gdn = state_bytes(mixer_options(hybrid_config), teacher_config.num_attention_heads, head_dim(teacher_config),
                      dtype)
    total = teacher[str(context)]
    return {"context": context, "kv_dtype": str(dtype).replace("torch.", ""),
            "kv_bytes": {"teacher": teacher, "hybrid": hybrid},
            "kv_fraction": hybrid[str(context)] / total,
            "kv_bytes_by_type": by_type,
            "window_saving": 1 - total / (full * len(layers)),
            "floor_fraction": sum(min(b, gdn) for b in layers) / total,
            "full_layer_fraction": full / total}


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def cache_rows(report: dict) -> list[tuple[str, str]]:
    """Printed rows of a cache_report: bytes per sequence at each length, the kept fraction at the context, and,
    where windows already bound most of the teacher's cache, what a budget can still buy."""
    b = report["kv_bytes"]
    rows = [(f"KV cache per sequence at {_tokens(int(n))}: teacher / hybrid",
             f"{_size(b['teacher'][n])} / {_size(b['hybrid'][n])}") for n in b["teacher"]]
    L = _tokens(report["context"])
    rows.append((f"KV cache kept (bytes at {L}, {report['kv_dtype']})", f"{report['kv_fraction']:.1%} of the teacher's"))
    if report["window_saving"] > MOST:
        rows.append(("sliding windows", f"already cap the teacher at {1 - report['window_saving']:.0%} of full "
                     f"attention at {L}: a hybrid caches at least {report['floor_fraction']:.0%} of it (GDN states), "
                     f"each full-attention layer kept costs {report['full_layer_fraction']:.0%}"))
    return rows


def measured_cache_bytes(cache) -> int:
    """Bytes of every tensor a transformers Cache holds (keys, values, conv and recurrent states): the check of the
    figures above."""
    seen, total = set(), 0
    for layer in cache.layers:
        tensors = [getattr(layer, "keys", None), getattr(layer, "values", None)]
        for name in ("conv_states", "recurrent_states"):
            tensors += list((getattr(layer, name, None) or {}).values())
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total
