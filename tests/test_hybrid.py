"""Hybrid model: teacher equivalence, conversion of every architecture, cached decoding, save/load."""
import dataclasses

import pytest
import torch
from conftest import ARCHS, decoded_logits, tiny_teacher
from transformers import AutoModelForCausalLM

from taylor_calibrate import GDNConfig, HybridForCausalLM, convert_teacher
from taylor_calibrate.model.mixers.gdn import GatedDeltaNet

VOCAB = 97


def _ids(b=2, t=24, seed=0):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def test_zero_converted_layers_reproduce_teacher_exactly(arch):
    teacher = tiny_teacher(arch)
    hybrid = convert_teacher(teacher, [], GDNConfig())
    ids = _ids()
    assert torch.equal(hybrid(ids, use_cache=False).logits, teacher(ids, use_cache=False).logits)


@pytest.mark.parametrize("gdn_cfg", [GDNConfig(), GDNConfig(short_conv="random", gate="sigmoid", v_activation="identity"),
                                     GDNConfig(output_norm=False, gate="none")], ids=["default", "conv", "plain"])
def test_most_layers_converted_forward_backward_finite(arch, gdn_cfg):
    teacher = tiny_teacher(arch)
    hybrid = convert_teacher(teacher, [1, 2, 3], gdn_cfg).train()
    assert set(hybrid.gdn_mixers) == {1, 2, 3}
    assert all(isinstance(m, GatedDeltaNet) for m in hybrid.gdn_mixers.values())
    ids = _ids()
    out = hybrid(ids, labels=ids, use_cache=False)
    assert torch.isfinite(out.logits).all()
    out.loss.backward()
    grads = [p.grad for p in hybrid.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    mixer = hybrid.gdn_mixers[2]
    for name in ("A_log", "dt_bias", "a_proj", "b_proj", "q_proj"):
        p = getattr(mixer, name)
        g = p.grad if isinstance(p, torch.nn.Parameter) else p.weight.grad
        assert g.abs().sum() > 0, f"{name} gets no gradient"


def test_weight_transfer_repeats_gqa_heads():
    teacher = tiny_teacher("qwen2")  # 4 query / 2 KV heads, with q/k/v biases
    hybrid = convert_teacher(teacher, [1], GDNConfig())
    attn, gdn = teacher.model.layers[1].self_attn, hybrid.gdn_mixers[1]
    D = 16
    assert torch.equal(gdn.q_proj.weight, attn.q_proj.weight) and torch.equal(gdn.q_proj.bias, attn.q_proj.bias)
    assert torch.equal(gdn.o_proj.weight, attn.o_proj.weight)
    for h in range(4):  # query head h reads KV head h // 2
        kv = h // 2
        assert torch.equal(gdn.k_proj.weight[h * D:(h + 1) * D], attn.k_proj.weight[kv * D:(kv + 1) * D])
        assert torch.equal(gdn.v_proj.bias[h * D:(h + 1) * D], attn.v_proj.bias[kv * D:(kv + 1) * D])
    # kept layers and MLPs are the teacher's weights
    assert torch.equal(hybrid.model.layers[1].mlp.up_proj.weight, teacher.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(hybrid.model.layers[0].self_attn.q_proj.weight, teacher.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
@pytest.mark.parametrize("kept", [None, {1: [0]}], ids=["whole", "headwise"])
def test_qk_norm_fold_points_q_and_k_where_the_teachers_normed_ones_point(arch, kept):
    """--gdn.qk_norm fold: with no conv and no activation, the GDN's L2-normalised q and k are the teacher's q/k
    RMSNorm outputs (Qwen3's w, Gemma 3's 1 + w; here random, with signs) normalised, per head; `drop` loses them."""
    teacher = tiny_teacher(arch)
    attn = teacher.model.layers[1].self_attn
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(1)) * 2)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(2))
    D, H = 16, 4
    heads = [0, 1, 2, 3] if kept is None else [2, 3]  # KV group 0 kept: query heads 2, 3 (KV head 1) convert
    want_q = attn.q_norm(attn.q_proj(x).view(2, 7, H, D))[:, :, heads]
    want_k = attn.k_norm(attn.k_proj(x).view(2, 7, 2, D))[:, :, [h // 2 for h in heads]]
    unit = lambda t: t / t.norm(dim=-1, keepdim=True)
    for mode in ("fold", "drop"):
        cfg = GDNConfig(short_conv="none", qk_activation="identity", qk_norm=mode)
        mixer = convert_teacher(teacher, [1], cfg, kept_groups=kept).gdn_mixers[1]
        q, k, *_ = mixer.features(x)  # a head-wise layer's GDN part holds its converted heads only
        same = torch.allclose(q, unit(want_q), atol=1e-5) and torch.allclose(k, unit(want_k), atol=1e-5)
        assert same == (mode == "fold"), mode


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_qk_norm_fold_leaves_teachers_without_q_k_norms_as_they_were(arch):
    teacher = tiny_teacher(arch)
    a, b = (convert_teacher(teacher, [1, 2], GDNConfig(qk_norm=m)).gdn_mixers for m in ("fold", "drop"))
    for i in (1, 2):
        sa, sb = a[i].state_dict(), b[i].state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("short_conv", ["none", "random"])
def test_cached_decoding_equals_full_forward(arch, short_conv):
    teacher = tiny_teacher(arch)
    hybrid = convert_teacher(teacher, [1, 2], GDNConfig(short_conv=short_conv))
    ids = _ids(t=30)
    full = hybrid(ids, use_cache=False).logits
    torch.testing.assert_close(decoded_logits(hybrid, ids, 17), full, rtol=1e-4, atol=1e-4)


def test_generate_with_hybrid_cache_and_left_padding():
    teacher = tiny_teacher("llama")
    hybrid = convert_teacher(teacher, [1, 3], GDNConfig(short_conv="random"))
    hybrid.generation_config.pad_token_id = 0
    prompt = _ids(b=1, t=9)
    alone = hybrid.generate(prompt, max_new_tokens=6, do_sample=False)
    # the same prompt left-padded in a batch must generate the same tokens (padding invisible to GDN and attention)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
    batch = torch.cat([padded, _ids(b=1, t=12, seed=1)], 0)
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    both = hybrid.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(both[0, -6:], alone[0, -6:])


def test_save_load_roundtrip_identical_logits(tmp_path, arch):
    teacher = tiny_teacher(arch, tie_word_embeddings=(arch == "llama"))
    hybrid = convert_teacher(teacher, [0, 2], GDNConfig(short_conv="identity"))
    hybrid.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=hybrid.config._attn_implementation)
    assert isinstance(loaded, HybridForCausalLM)
    assert loaded.config.layer_types == hybrid.config.layer_types
    ids = _ids()
    assert torch.equal(loaded(ids, use_cache=False).logits, hybrid(ids, use_cache=False).logits)
    if arch == "llama":
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_layer_types_record_conversion():
    teacher = tiny_teacher("gemma3_text")
    hybrid = convert_teacher(teacher, [1], GDNConfig())
    assert hybrid.config.layer_types == ["sliding_attention", "linear_attention", "sliding_attention", "full_attention"]
    assert hybrid.config.gdn_layers == [1]


def test_bad_gdn_options_are_named():
    with pytest.raises(ValueError, match="short_conv"):
        GDNConfig(short_conv="yes")
    with pytest.raises(ValueError, match="conv_size"):
        GDNConfig(short_conv="identity", conv_size=0)
    with pytest.raises(ValueError, match="unknown GDN option"):
        GDNConfig.from_dict({"shortconv": "none"})


def test_a_stored_config_from_before_an_option_reads_as_what_was_done_then():
    """A hybrid saved before `qk_norm` existed was converted by dropping the teacher's q/k norms: its config must not
    claim the fold that is the default now."""
    stored = dataclasses.asdict(GDNConfig())
    assert GDNConfig.from_dict(stored).qk_norm == "fold"
    del stored["qk_norm"]
    assert GDNConfig.from_dict(stored).qk_norm == "drop"
    assert GDNConfig.from_dict({**stored, "qk_norm": "fold"}).qk_norm == "fold"


@pytest.mark.parametrize("arch_name", ARCHS)
def test_every_supported_arch_builds_from_config(arch_name):
    from taylor_calibrate.teacher import check_architecture

    check_architecture(tiny_teacher(arch_name).config)


def test_convert_keeps_the_teachers_fp32_rope_frequencies():
    """A bf16 teacher keeps inv_freq in fp32; the hybrid built and cast to bf16 must too (a bf16 inv_freq is 0.3% off:
    radians of RoPE phase after a few thousand positions in every kept attention layer)."""
    from conftest import tiny_config
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.bfloat16)
    assert teacher.model.rotary_emb.inv_freq.dtype == torch.float32
    hybrid = convert_teacher(teacher, [1, 2, 3], GDNConfig())
    assert torch.equal(hybrid.model.rotary_emb.inv_freq, teacher.model.rotary_emb.inv_freq)
    assert hybrid.model.rotary_emb.inv_freq.dtype == torch.float32


def _padded_batch():
    """Two prompts, the second left-padded by 3: (ids, attention_mask)."""
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("kept_groups", [None, {2: [1]}], ids=["whole", "headwise"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_static_cache_generate_equals_dynamic(arch, kept_groups, single_thread):
    """generate(cache_implementation="static") hands the model one prepared mask per layer type (a dict); the hybrid
    gives its base model the attention ones and keeps the 2-D padding mask for its GDN layers: same tokens as the
    dynamic cache, left padding included, with kept attention layers, GDN layers and a head-wise layer."""
    hybrid = convert_teacher(tiny_teacher(arch), [1, 2], GDNConfig(short_conv="random"), kept_groups=kept_groups)
    ids, mask = _padded_batch()
    with torch.no_grad():
        dynamic = hybrid.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        static = hybrid.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                 cache_implementation="static")
    assert torch.equal(dynamic, static)


def test_compiled_static_generate_equals_dynamic(single_thread):
    """generate's own torch.compile of the decode step (forced on a CPU through compile_config) traces the hybrid's
    forward over a StaticCache as one graph (fullgraph: no break) and decodes the same tokens as the eager dynamic
    cache; a counting backend shows that the compiled step ran."""
    from transformers import CompileConfig

    hybrid = convert_teacher(tiny_teacher("llama"), [1, 2], GDNConfig(short_conv="random"), kept_groups={2: [1]})
    ids, mask = _padded_batch()
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return torch._inductor.compile(gm, example_inputs)

    config = CompileConfig(fullgraph=True, backend=inductor, mode=None)
    config._compile_all_devices = True  # transformers' switch for compiling off CUDA
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            dynamic = hybrid.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
            compiled = hybrid.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                       cache_implementation="static", compile_config=config)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    assert torch.equal(dynamic, compiled)


@pytest.mark.parametrize("short_conv", ["random", "none"])
def test_state_bytes_are_what_the_cache_holds(short_conv):
    """The spec's state size (memory accounting) equals the recurrent + conv state the cache keeps per sequence."""
    hybrid = convert_teacher(tiny_teacher("qwen2"), [1, 3], GDNConfig(short_conv=short_conv), kept_groups={3: [1]})
    with torch.no_grad():
        cache = hybrid(_ids(b=1, t=9), use_cache=True).cache
    held = {i: sum(t.numel() * t.element_size() for states in (cache.layers[i].conv_states,
                                                                cache.layers[i].recurrent_states)
                   for t in states.values() if t is not None) for i in (1, 3)}
    assert hybrid.state_bytes() == held and held[1] > held[3] > 0


def test_a_checkpoint_without_the_mixer_key_loads_as_gdn(tmp_path):
    """Checkpoints written before the config named its mixer (a `gdn` block only) load as GDN, unchanged."""
    import json

    hybrid = convert_teacher(tiny_teacher("llama"), [1, 2], GDNConfig(short_conv="identity"))
    hybrid.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg.pop("mixer") == "gdn" and cfg["gdn"]["short_conv"] == "identity"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=hybrid.config._attn_implementation)
    assert loaded.config.mixer == "gdn" and isinstance(loaded.gdn_mixers[1], GatedDeltaNet)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, hybrid(ids).logits)


def test_unknown_mixer_in_a_config_is_named(tmp_path):
    hybrid = convert_teacher(tiny_teacher("llama"), [1], GDNConfig())
    hybrid.config.mixer = "mamba9"
    with pytest.raises(ValueError, match="unknown mixer 'mamba9'; known: gdn"):
        HybridForCausalLM(hybrid.config)
