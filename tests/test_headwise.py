"""Head-wise hybrids: some KV groups of a layer stay softmax attention, the other heads become one GDN mixer."""
import pytest
import torch
from conftest import decoded_logits, tiny_teacher
from transformers import AutoModelForCausalLM

from taylor_calibrate import GDNConfig, HybridForCausalLM, convert_teacher
from taylor_calibrate.model.hybrid import HeadwiseMixer, attention_part

VOCAB = 97
KEPT = {1: [0], 2: [1]}  # tiny teachers have 2 KV groups of 2 query heads: layer 1 keeps group 0, layer 2 group 1


def _ids(b=2, t=24, seed=0):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _attn_out(attn, model, ids, layer):
    """Run `attn` on what layer `layer`'s attention of `model` receives."""
    got = {}

    def grab(mod, args, kwargs):
        got["kw"] = dict(kwargs)

    h = model.model.layers[layer].self_attn.register_forward_pre_hook(grab, with_kwargs=True)
    model(ids, use_cache=False)
    h.remove()
    kw = got["kw"]
    return attn(**{k: v for k, v in kw.items() if k != "cache"}, cache=None)[0]


def test_attention_parts_sum_to_the_teacher_attention(arch):
    """Slicing is exact: kept groups + the rest (without W_O's bias) = the whole attention, for every architecture."""
    teacher = tiny_teacher(arch)
    attn = teacher.model.layers[1].self_attn
    ids = _ids()
    whole = _attn_out(attn, teacher, ids, 1)
    a = _attn_out(attention_part(attn, teacher.config, [0]), teacher, ids, 1)
    b = _attn_out(attention_part(attn, teacher.config, [1], o_bias=False), teacher, ids, 1)
    torch.testing.assert_close(a + b, whole, rtol=1e-5, atol=1e-5)


def test_headwise_layer_types_and_mixers():
    hybrid = convert_teacher(tiny_teacher("gemma3_text"), [1, 2, 3], GDNConfig(), kept_groups=KEPT)
    assert hybrid.config.layer_types == ["sliding_attention", "hybrid_sliding", "hybrid_sliding", "linear_attention"]
    assert hybrid.config.gdn_layers == [1, 2, 3] and hybrid.config.kept_groups(1) == [0]
    assert isinstance(hybrid.model.layers[1].self_attn, HeadwiseMixer)
    assert hybrid.gdn_mixers[1].num_heads == 2 and hybrid.gdn_mixers[3].num_heads == 4


@pytest.mark.parametrize("short_conv", ["none", "random"])
def test_headwise_cached_decoding_equals_full_forward(arch, short_conv):
    hybrid = convert_teacher(tiny_teacher(arch), [1, 2, 3], GDNConfig(short_conv=short_conv), kept_groups=KEPT)
    ids = _ids(t=30)
    full = hybrid(ids, use_cache=False).logits
    torch.testing.assert_close(decoded_logits(hybrid, ids, 17), full, rtol=1e-4, atol=1e-4)


def test_headwise_save_load_roundtrip(tmp_path, arch):
    hybrid = convert_teacher(tiny_teacher(arch), [1, 2], GDNConfig(short_conv="random"), kept_groups=KEPT)
    hybrid.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=hybrid.config._attn_implementation)
    assert isinstance(loaded, HybridForCausalLM) and loaded.config.attention_heads == {"1": [0], "2": [1]}
    ids = _ids()
    assert torch.equal(loaded(ids, use_cache=False).logits, hybrid(ids, use_cache=False).logits)
    hybrid.generation_config.pad_token_id = loaded.generation_config.pad_token_id = 0
    a = hybrid.generate(ids[:1, :9], max_new_tokens=5, do_sample=False)
    assert torch.equal(loaded.generate(ids[:1, :9], max_new_tokens=5, do_sample=False), a)


def test_headwise_keeps_teacher_heads_exactly():
    """The kept heads' weights are the teacher's; the GDN part copies the other heads (GQA repeated)."""
    teacher = tiny_teacher("qwen2")
    hybrid = convert_teacher(teacher, [1], GDNConfig(), kept_groups={1: [1]})
    attn, mixer = teacher.model.layers[1].self_attn, hybrid.model.layers[1].self_attn
    D = 16
    assert torch.equal(mixer.attn.q_proj.weight, attn.q_proj.weight[2 * D:])  # group 1 = query heads 2, 3
    assert torch.equal(mixer.attn.k_proj.weight, attn.k_proj.weight[D:])
    assert torch.equal(mixer.gdn.q_proj.weight, attn.q_proj.weight[:2 * D])
    assert torch.equal(mixer.gdn.k_proj.weight[D:2 * D], attn.k_proj.weight[:D])  # head 1 reads group 0
    assert torch.equal(mixer.gdn.o_proj.weight, attn.o_proj.weight[:, :2 * D])


def test_headwise_attention_implementation_switches_everywhere(arch):
    """set_attn_implementation reaches the kept heads of head-wise layers too (their module has its own config), and
    the outputs do not change with it."""
    hybrid = convert_teacher(tiny_teacher(arch), [1, 2, 3], GDNConfig(), kept_groups=KEPT).eval()
    ids = _ids()
    with torch.no_grad():
        before = hybrid(ids, use_cache=False).logits
        other = "sdpa" if hybrid.config._attn_implementation == "eager" else "eager"
        hybrid.set_attn_implementation(other)
        after = hybrid(ids, use_cache=False).logits
    impls = {m.config._attn_implementation for m in hybrid.modules() if hasattr(m, "q_proj") and hasattr(m, "config")}
    assert impls == {other}
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
