"""The hybrid model: the teacher's own modules with chosen attention layers swapped for linear mixers (GDN, or any
mixer registered in model/mixers, named by the config's `mixer`).

`HybridForCausalLM` wraps the teacher architecture's base model (`LlamaModel`, `Qwen3Model`, `Gemma3TextModel`,
...) built from the stored teacher config, so state-dict keys equal the teacher's for everything that was kept
(`model.layers.3.mlp.up_proj.weight`, ...). Importing `taylor_calibrate` registers the config and model with the
Auto* factories, so `AutoModelForCausalLM.from_pretrained(out_dir)` works without `trust_remote_code`.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModel, DynamicCache, GenerationMixin, PreTrainedModel
from transformers.initialization import no_init_weights
from transformers.modeling_outputs import CausalLMOutputWithPast

from taylor_calibrate.model.hybrid_config import (ATTENTION_TYPES, HEADWISE_TYPES, MIXER_TYPE, HybridConfig,
                                                  cached_layer_types)
from taylor_calibrate.model.loading import check_loaded, check_report
from taylor_calibrate.model.mixers import MIXERS, get_spec, spec_for_options
from taylor_calibrate.ops import resolve_backend

log = logging.getLogger("taylor_calibrate")


def base_config_of(config: HybridConfig):
    """The teacher's own config object, rebuilt from the dict stored in the hybrid config."""
    base = dict(config.base_config)
    return AutoConfig.for_model(base.pop("model_type"), **base)


def teacher_layer_types(teacher_config) -> list[str]:
    """Attention kind of every teacher layer ("full_attention" / "sliding_attention"; a Mistral with a window slides
    in every layer), so that the hybrid's cache keeps a kept layer's window only, as the teacher's does."""
    types = cached_layer_types(teacher_config)
    bad = sorted(set(types) - set(ATTENTION_TYPES))
    if bad:
        raise ValueError(f"teacher layer types {bad} are not softmax attention; cannot convert this teacher")
    return types


def make_hybrid_config(teacher_config, gdn_layers: list[int], options, teacher_name: str | None = None,
                       kept_groups: dict[int, list[int]] | None = None):
    """`options`: the mixer's options dataclass (a GDNConfig, ...), which also says which mixer; `kept_groups`: for
    head-wise layers among `gdn_layers`, the KV groups that stay softmax attention."""
    spec = spec_for_options(options)
    types = teacher_layer_types(teacher_config)
    kept_groups = {i: sorted(g) for i, g in (kept_groups or {}).items() if g and i in gdn_layers}
    for i in gdn_layers:
        types[i] = HEADWISE_TYPES[types[i]] if i in kept_groups else MIXER_TYPE
    base = teacher_config.to_dict()
    base.pop("quantization_config", None)  # GGUF teachers are dequantised on load
    for k in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        base.pop(k, None)
    return HybridConfig(base_config=base, layer_types=types, mixer=spec.name, teacher_name=teacher_name,
                        attention_heads={str(i): g for i, g in kept_groups.items()} or None,
                        architectures=["HybridForCausalLM"], **{spec.name: dataclasses.asdict(options)})


def head_dim_of(cfg) -> int:
    """A config's attention head dim (explicit, or hidden size / heads)."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def group_heads(cfg, groups: list[int]) -> list[int]:
    """The query heads that read KV groups `groups` (GQA: query head h reads group h // (heads / kv_heads))."""
    per = cfg.num_attention_heads // cfg.num_key_value_heads
    return [g * per + j for g in sorted(groups) for j in range(per)]


def converted_heads(cfg, kept: list[int]) -> list[int]:
    """Query heads of a layer that become GDN heads when the KV groups `kept` stay attention."""
    return group_heads(cfg, [g for g in range(cfg.num_key_value_heads) if g not in set(kept)])


def gdn_heads(cfg, layers, kept_groups: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    """{layer: its GDN query heads} for converted `layers`: every head, or those outside a head-wise layer's kept KV
    groups (`kept_groups`)."""
    return {i: converted_heads(cfg, (kept_groups or {}).get(i) or []) for i in layers}


def kept_heads(cfg, layers, kept_groups: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    """{layer: its query heads that stay softmax attention} when `layers` are converted: every head of a layer not
    converted, the kept KV groups' heads of a head-wise layer; layers with none are left out."""
    out = {i: group_heads(cfg, (kept_groups or {}).get(i) or []) if i in set(layers)
           else list(range(cfg.num_attention_heads)) for i in range(cfg.num_hidden_layers)}
    return {i: h for i, h in out.items() if h}


def _new_mixer(base, options, layer_idx: int, attn: nn.Module, kept: list[int] = ()) -> nn.Module:
    """The mixer of a converted layer; head-wise (`kept` groups stay attention) it holds the other heads only, and
    the o_proj bias stays with the attention part."""
    heads = len(converted_heads(base, kept))
    return spec_for_options(options).build(base.hidden_size, heads, head_dim_of(base), options, layer_idx,
                                           qkv_bias=attn.q_proj.bias is not None,
                                           o_bias=attn.o_proj.bias is not None and not kept)


@torch.no_grad()
def attention_part(attn: nn.Module, config, groups: list[int], o_bias: bool = True) -> nn.Module:
    """The teacher's own attention module restricted to KV groups `groups` (their query heads, keys, values and
    W_O columns): same class, so RoPE, q/k norms, windows and softcap behave as the teacher's. `o_bias=False` leaves
    W_O's bias out (for a GDN mixer copied from the part; the bias stays with the kept heads)."""
    cfg = copy.deepcopy(config)
    D = head_dim_of(config)
    q = torch.tensor(group_heads(config, groups))
    kv = torch.tensor(sorted(groups))
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = len(q), len(kv), D
    w = attn.q_proj.weight
    with torch.device(w.device):
        part = type(attn)(cfg, attn.layer_idx).to(w.dtype)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    for name, heads in rows.items():
        src, dst = getattr(attn, name), getattr(part, name)
        dst.weight.copy_(src.weight.view(-1, D, src.weight.shape[1])[heads].flatten(0, 1))
        if src.bias is not None:
            dst.bias.copy_(src.bias.view(-1, D)[heads].flatten())
    part.o_proj.weight.copy_(attn.o_proj.weight.view(attn.o_proj.weight.shape[0], -1, D)[:, q].flatten(1))
    if attn.o_proj.bias is not None:
        if o_bias:
            part.o_proj.bias.copy_(attn.o_proj.bias)
        else:
            part.o_proj.bias = None
    for name, module in attn.named_children():  # q/k norms (Qwen3, Gemma 3) act per head, shared by heads
        if name not in rows and name != "o_proj":
            part.get_submodule(name).load_state_dict(module.state_dict())
    return part


class HeadwiseMixer(nn.Module):
    """A layer converted head-wise: the kept KV groups stay the teacher's softmax attention (KV cached for them
    only), the other query heads are one linear mixer (attribute `gdn`, whatever the mixer: the checkpoint key). W_O
    is linear in the heads, so the layer's output is the sum of the two parts' outputs, each through its own columns
    of W_O."""

    def __init__(self, attn: nn.Module, gdn: nn.Module):
        super().__init__()
        self.attn, self.gdn = attn, gdn

    def forward(self, hidden_states, **kwargs):
        a, weights = self.attn(hidden_states, **kwargs)
        g, _ = self.gdn(hidden_states, **kwargs)
        return a + g, weights


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' loader, refusing a directory whose weights leave parameters of its config to a random init
        (which transformers only logs) or whose report.json describes another model."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        check_loaded(pretrained_model_name_or_path, info, "convert again into a new --out", unexpected=True)
        check_report(pretrained_model_name_or_path, model.config)
        return (model, info) if want_info else model

    def set_attn_implementation(self, attn_implementation, **kwargs):
        """transformers' switch, carried on to the kept heads of head-wise layers: their attention module has its own
        config (fewer heads), which transformers' walk over the model's configs does not reach."""
        super().set_attn_implementation(attn_implementation, **kwargs)
        impl = self.config._attn_implementation
        for m in self.modules():
            if isinstance(m, HeadwiseMixer):
                m.attn.config._attn_implementation = impl

    def _init_weights(self, module):
        spec = next((s for s in MIXERS.values() if isinstance(module, s.module)), None)
        if spec is not None:
            spec.init_weights(module, torch.Generator().manual_seed(module.layer_idx))
        elif hasattr(self, "model") and isinstance(self.model, PreTrainedModel):
            self.model._init_weights(module)


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        base = base_config_of(config)
        self.model = AutoModel.from_config(base, attn_implementation=config._attn_implementation)
        options = get_spec(config.mixer).options(config.mixer_options)
        for i in config.gdn_layers:
            layer, kept = self.model.layers[i], config.kept_groups(i)
            mixer = _new_mixer(base, options, i, layer.self_attn, kept)
            layer.self_attn = HeadwiseMixer(attention_part(layer.self_attn, base, kept), mixer) if kept else mixer
        self.lm_head = nn.Linear(base.hidden_size, base.vocab_size, bias=False)
        self.post_init()

    @property
    def gdn_mixers(self) -> dict[int, nn.Module]:
        """The linear mixer of every converted layer (of a head-wise layer: its mixer part)."""
        mixers = {i: self.model.layers[i].self_attn for i in self.config.gdn_layers}
        return {i: getattr(m, "gdn", m) for i, m in mixers.items()}

    def state_bytes(self) -> dict[int, int]:
        """{layer: bytes of its mixer's decoding state (recurrent + conv) for one sequence}, from the mixer's spec;
        a head-wise layer's kept heads add a KV cache that grows with the context (not counted here)."""
        spec = get_spec(self.config.mixer)
        options, size = spec.options(self.config.mixer_options), next(self.parameters()).element_size()
        return {i: spec.state_bytes(options, m.num_heads, m.head_dim, size) for i, m in self.gdn_mixers.items()}

    def set_backend(self, backend: str) -> str:
        """Resolve the kernel backend once (logged) and use it in every mixer layer."""
        resolved = resolve_backend(backend)
        for m in self.gdn_mixers.values():
            m.backend = resolved
        return resolved

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)  # KV layers for attention, recurrent-state layers for mixers
        padding = attention_mask
        if isinstance(attention_mask, dict):  # generate() with a static cache: one prepared mask per layer type
            padding = attention_mask.get(MIXER_TYPE)
            kept = {k: v for k, v in attention_mask.items() if k != MIXER_TYPE}
            attention_mask = kept if len(kept) > 1 else next(iter(kept.values()), None)
        gdn_mask = None
        if isinstance(padding, torch.Tensor) and padding.dim() == 2 and not bool(padding.all()):
            gdn_mask = padding
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, gdn_mask=gdn_mask, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma-family logit softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None,
                                      hidden_states=getattr(out, "hidden_states", None))


@torch.no_grad()
def make_mixers(teacher: PreTrainedModel, layers: list[int], options, seed: int = 0,
                kept_groups: dict[int, list[int]] | None = None) -> dict[int, nn.Module]:
    """Copy-only mixers (of the mixer whose options dataclass `options` is) for `layers` of `teacher` (docs/method.md, "Weight transfer"): W_Q, W_K, W_V, W_O (GQA repeated),
    library-default recurrent parameters; a head-wise layer's mixer (`kept_groups`) holds its converted heads only.
    They sit on the teacher's device and dtype."""
    spec = spec_for_options(options)
    tcfg = teacher.config
    param = next(teacher.parameters())
    mixers = {}
    for i in layers:
        attn, kept = teacher.model.layers[i].self_attn, (kept_groups or {}).get(i, [])
        with torch.device(param.device):
            mixer = _new_mixer(tcfg, options, i, attn, kept).to(param.dtype)
        num_kv = tcfg.num_key_value_heads
        if kept:
            rest = [g for g in range(num_kv) if g not in set(kept)]
            attn, num_kv = attention_part(attn, tcfg, rest, o_bias=False), len(rest)
        spec.copy_from_attention(mixer, attn, num_kv)
        spec.init_weights(mixer, torch.Generator().manual_seed(seed * 1000 + i))
        mixers[i] = mixer
    return mixers


@contextlib.contextmanager
def swapped_into(teacher: PreTrainedModel, mixers: dict[int, nn.Module]):
    """Temporarily put mixers in place of the teacher's attention: a cheap hybrid for cache-free evaluation
    (policy search, ablations) without building a model per layer set."""
    layers = teacher.model.layers
    saved = {i: layers[i].self_attn for i in mixers}
    try:
        for i, m in mixers.items():
            layers[i].self_attn = m
        yield teacher
    finally:
        for i, a in saved.items():
            layers[i].self_attn = a


@torch.no_grad()
def copy_buffers(src: nn.Module, dst: nn.Module) -> None:
    """Give `dst` the buffers of `src` that it shares by name (RoPE's inv_freq), dtype included: `.to(bf16)` of a
    freshly built model casts inv_freq to bf16 (a rounding error that grows to radians of phase at long positions),
    while the teacher, loaded with its dtype, keeps it fp32."""
    mods = dict(dst.named_modules())
    for name, buf in src.named_buffers():
        owner, _, leaf = name.rpartition(".")
        mod = mods.get(owner)
        if mod is not None and leaf in mod._buffers and mod._buffers[leaf] is not None:
            mod._buffers[leaf] = buf.detach().clone()


def convert_teacher(teacher: PreTrainedModel, gdn_layers: list[int], options, *, teacher_name: str | None = None,
                    seed: int = 0, mixers: dict[int, nn.Module] | None = None,
                    kept_groups: dict[int, list[int]] | None = None) -> HybridForCausalLM:
    """Build the hybrid: the teacher's weights everywhere, mixers at `gdn_layers` (those of the mixer whose options
    dataclass `options` is, e.g. a GDNConfig; copy-only ones from `make_mixers` unless calibrated `mixers` are
    given); `kept_groups` makes some of them head-wise."""
    tcfg = teacher.config
    cfg = make_hybrid_config(tcfg, gdn_layers, options, teacher_name, kept_groups)
    cfg._attn_implementation = getattr(tcfg, "_attn_implementation", None) or "sdpa"
    param = next(teacher.parameters())
    with no_init_weights(), torch.device(param.device):
        hybrid = HybridForCausalLM(cfg).to(param.dtype)
    prefixes = tuple(f"model.layers.{i}.self_attn." for i in gdn_layers)
    kept = {k: v for k, v in teacher.state_dict().items() if not k.startswith(prefixes)}
    missing, unexpected = hybrid.load_state_dict(kept, strict=False)
    missing = [k for k in missing if not k.startswith(prefixes) and k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"teacher -> hybrid weight map failed: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hybrid.tie_weights()  # re-share lm_head and embeddings when the teacher ties them (load_state_dict copied both)
    copy_buffers(teacher, hybrid)
    if mixers is None:
        mixers = make_mixers(teacher, gdn_layers, options, seed, kept_groups)
    for i, mixer in hybrid.gdn_mixers.items():
        mixer.load_state_dict(mixers[i].state_dict())
        kept = cfg.kept_groups(i)
        if kept:
            part = attention_part(teacher.model.layers[i].self_attn, tcfg, kept)
            hybrid.model.layers[i].self_attn.attn.load_state_dict(part.state_dict())
    hybrid.eval()
    return hybrid
