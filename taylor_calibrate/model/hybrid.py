"""The hybrid model: the teacher's own modules with chosen attention layers swapped for GDN mixers.

`HybridForCausalLM` wraps the teacher architecture's base model (`LlamaModel`, `Qwen3Model`, `Gemma3TextModel`,
...) built from the stored teacher config, so state-dict keys equal the teacher's for everything that was kept
(`model.layers.3.mlp.up_proj.weight`, ...). Importing `taylor_calibrate` registers the config and model with the
Auto* factories, so `AutoModelForCausalLM.from_pretrained(out_dir)` works without `trust_remote_code`.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModel, DynamicCache, GenerationMixin, PreTrainedModel
from transformers.initialization import no_init_weights
from transformers.modeling_outputs import CausalLMOutputWithPast

from taylor_calibrate.config import ATTENTION_TYPES, GDN_TYPE, GDNConfig, HybridConfig, gdn_dict
from taylor_calibrate.model.gdn import GatedDeltaNet, copy_attention_weights, init_recurrent_defaults
from taylor_calibrate.ops import resolve_backend

log = logging.getLogger("taylor_calibrate")


def base_config_of(config: HybridConfig):
    """The teacher's own config object, rebuilt from the dict stored in the hybrid config."""
    base = dict(config.base_config)
    return AutoConfig.for_model(base.pop("model_type"), **base)


def teacher_layer_types(teacher_config) -> list[str]:
    """Attention kind of every teacher layer ("full_attention" / "sliding_attention")."""
    n = teacher_config.num_hidden_layers
    types = list(getattr(teacher_config, "layer_types", None) or ["full_attention"] * n)
    bad = sorted(set(types) - set(ATTENTION_TYPES))
    if bad:
        raise ValueError(f"teacher layer types {bad} are not softmax attention; cannot convert this teacher")
    return types


def make_hybrid_config(teacher_config, gdn_layers: list[int], gdn: GDNConfig, teacher_name: str | None = None):
    types = teacher_layer_types(teacher_config)
    for i in gdn_layers:
        types[i] = GDN_TYPE
    base = teacher_config.to_dict()
    base.pop("quantization_config", None)  # GGUF teachers are dequantised on load
    for k in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        base.pop(k, None)
    return HybridConfig(base_config=base, layer_types=types, gdn=gdn_dict(gdn), teacher_name=teacher_name,
                        architectures=["HybridForCausalLM"])


def _new_gdn(base, gdn_cfg: GDNConfig, layer_idx: int, attn: nn.Module) -> GatedDeltaNet:
    head_dim = getattr(base, "head_dim", None) or base.hidden_size // base.num_attention_heads
    return GatedDeltaNet(base.hidden_size, base.num_attention_heads, head_dim, gdn_cfg, layer_idx,
                         qkv_bias=gdn_cfg.bias and attn.q_proj.bias is not None,
                         o_bias=gdn_cfg.bias and attn.o_proj.bias is not None)


class HybridPreTrainedModel(PreTrainedModel):
    config_class = HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        if isinstance(module, GatedDeltaNet):
            init_recurrent_defaults(module, torch.Generator().manual_seed(module.layer_idx))
        elif hasattr(self, "model") and isinstance(self.model, PreTrainedModel):
            self.model._init_weights(module)


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        base = base_config_of(config)
        self.model = AutoModel.from_config(base, attn_implementation=config._attn_implementation)
        gdn_cfg = config.gdn_config
        for i in config.gdn_layers:
            layer = self.model.layers[i]
            layer.self_attn = _new_gdn(base, gdn_cfg, i, layer.self_attn)
        self.lm_head = nn.Linear(base.hidden_size, base.vocab_size, bias=False)
        self.post_init()

    @property
    def gdn_mixers(self) -> dict[int, GatedDeltaNet]:
        return {i: self.model.layers[i].self_attn for i in self.config.gdn_layers}

    def set_backend(self, backend: str) -> str:
        """Resolve the GDN kernel backend once (logged) and use it in every GDN layer."""
        resolved = resolve_backend(backend)
        for m in self.gdn_mixers.values():
            m.backend = resolved
        return resolved

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, logits_to_keep=0, past_key_values=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)  # KV layers for attention, recurrent-state layers for GDN
        padding = attention_mask
        if isinstance(attention_mask, dict):  # generate() with a static cache: one prepared mask per layer type
            padding = attention_mask.get(GDN_TYPE)
            kept = {k: v for k, v in attention_mask.items() if k != GDN_TYPE}
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
def make_mixers(teacher: PreTrainedModel, layers: list[int], gdn: GDNConfig, seed: int = 0) -> dict[int, GatedDeltaNet]:
    """Copy-only GDN mixers for `layers` of `teacher` (docs/method.md, "Weight transfer"): W_Q, W_K, W_V, W_O (GQA
    repeated), library-default recurrent parameters. They sit on the teacher's device and dtype."""
    tcfg = teacher.config
    param = next(teacher.parameters())
    mixers = {}
    for i in layers:
        attn = teacher.model.layers[i].self_attn
        with torch.device(param.device):
            mixer = _new_gdn(tcfg, gdn, i, attn).to(param.dtype)
        copy_attention_weights(mixer, attn, tcfg.num_key_value_heads)
        init_recurrent_defaults(mixer, torch.Generator().manual_seed(seed * 1000 + i))
        mixers[i] = mixer
    return mixers


@contextlib.contextmanager
def swapped_into(teacher: PreTrainedModel, mixers: dict[int, GatedDeltaNet]):
    """Temporarily put GDN mixers in place of the teacher's attention: a cheap hybrid for cache-free evaluation
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
    freshly built model casts inv_freq to bf16 (0.4% off, radians of phase at a few thousand positions), while the
    teacher, loaded with its dtype, keeps it fp32."""
    mods = dict(dst.named_modules())
    for name, buf in src.named_buffers():
        owner, _, leaf = name.rpartition(".")
        mod = mods.get(owner)
        if mod is not None and leaf in mod._buffers and mod._buffers[leaf] is not None:
            mod._buffers[leaf] = buf.detach().clone()


def convert_teacher(teacher: PreTrainedModel, gdn_layers: list[int], gdn: GDNConfig, *, teacher_name: str | None = None,
                    seed: int = 0, mixers: dict[int, GatedDeltaNet] | None = None) -> HybridForCausalLM:
    """Build the hybrid: the teacher's weights everywhere, GDN mixers at `gdn_layers` (copy-only ones from
    `make_mixers` unless calibrated `mixers` are given)."""
    tcfg = teacher.config
    cfg = make_hybrid_config(tcfg, gdn_layers, gdn, teacher_name)
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
        mixers = make_mixers(teacher, gdn_layers, gdn, seed)
    for i, mixer in hybrid.gdn_mixers.items():
        mixer.load_state_dict(mixers[i].state_dict())
    hybrid.eval()
    return hybrid
