"""Export a hybrid to Qwen3.5's dense text format (`model_type: qwen3_5_text`, transformers' `Qwen3_5ForCausalLM`).

Qwen3.5 is a GDN + gated-attention hybrid that transformers, vLLM, SGLang and llama.cpp (`qwen35`) already run, so an
exported hybrid is served without our package. The map is exact when every piece of ours has a Qwen3.5 counterpart:

    linear mixer                       Qwen3.5 `linear_attn`: the mixer's own map (its spec's "qwen3_5" export;
                                       GDN's in model/mixers/gdn/export.py)

    kept attention                     Qwen3.5 `self_attn` (output multiplied by sigmoid(gate rows of q_proj))
    q_proj                         ->  q_proj, per head [query rows | zero gate rows]: sigmoid(0) = 1/2
    o_proj                         ->  o_proj x 2 (undoes the 1/2 exactly)
    q_norm, k_norm                 ->  q_norm, k_norm stored as w - 1 (every Qwen3.5 RMSNorm computes (1 + w))

The mixer must take the options Qwen3.5's layer fixes (its export's `problems` names what it lacks); the kept
attention needs per-head q/k RMSNorm (a Qwen3 teacher, or `convert --target qwen3_5`), full rotary
(partial_rotary_factor 1.0), no sliding window, a SiLU MLP without bias. `check_exportable` names what is not.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from taylor_calibrate.checkpoint import (REWRITE, check_hybrid_config, check_json_files, check_model_path,
                                        check_safetensors, check_state, check_tokenizer_files)
from taylor_calibrate.model.hybrid_config import MIXER_TYPE, HybridConfig
from taylor_calibrate.model.mixers import get_spec, spec_for_options
from taylor_calibrate.model.mixers.calibration import constant_direction

log = logging.getLogger("taylor_calibrate")

FORMATS = ("qwen3_5",)

# Our key (teacher layout under `model.`) -> Qwen3.5's key. `{l}` is the layer index. Tuples are concatenated along
# dim 0; the transform named after the key (see TRANSFORMS) is applied to the result.
WEIGHT_MAP = {
    "model.embed_tokens.weight": ("model.embed_tokens.weight", None),
    "model.norm.weight": ("model.norm.weight", "one_centered"),
    "lm_head.weight": ("lm_head.weight", None),
    "model.layers.{l}.input_layernorm.weight": ("model.layers.{l}.input_layernorm.weight", "one_centered"),
    "model.layers.{l}.post_attention_layernorm.weight": ("model.layers.{l}.post_attention_layernorm.weight",
                                                         "one_centered"),
    "model.layers.{l}.mlp.gate_proj.weight": ("model.layers.{l}.mlp.gate_proj.weight", None),
    "model.layers.{l}.mlp.up_proj.weight": ("model.layers.{l}.mlp.up_proj.weight", None),
    "model.layers.{l}.mlp.down_proj.weight": ("model.layers.{l}.mlp.down_proj.weight", None),
}
ATTENTION_MAP = {
    "model.layers.{l}.self_attn.q_proj.weight": ("model.layers.{l}.self_attn.q_proj.weight", "zero_gate_rows"),
    "model.layers.{l}.self_attn.q_proj.bias": ("model.layers.{l}.self_attn.q_proj.bias", "zero_gate_rows"),
    "model.layers.{l}.self_attn.k_proj.weight": ("model.layers.{l}.self_attn.k_proj.weight", None),
    "model.layers.{l}.self_attn.k_proj.bias": ("model.layers.{l}.self_attn.k_proj.bias", None),
    "model.layers.{l}.self_attn.v_proj.weight": ("model.layers.{l}.self_attn.v_proj.weight", None),
    "model.layers.{l}.self_attn.v_proj.bias": ("model.layers.{l}.self_attn.v_proj.bias", None),
    "model.layers.{l}.self_attn.o_proj.weight": ("model.layers.{l}.self_attn.o_proj.weight", "times_two"),
    "model.layers.{l}.self_attn.o_proj.bias": ("model.layers.{l}.self_attn.o_proj.bias", None),
    "model.layers.{l}.self_attn.q_norm.weight": ("model.layers.{l}.self_attn.q_norm.weight", "one_centered"),
    "model.layers.{l}.self_attn.k_norm.weight": ("model.layers.{l}.self_attn.k_norm.weight", "one_centered"),
}
def _zero_gate_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(H*D, ...) -> (H*2D, ...): each head's query rows followed by D zero rows, the output gate's pre-activation
    (Qwen3.5 splits q_proj's output per head into [query | gate])."""
    q = w.reshape(-1, head_dim, *w.shape[1:])
    return torch.cat([q, torch.zeros_like(q)], dim=1).reshape(-1, *w.shape[1:])


TRANSFORMS = {
    "one_centered": lambda w, D: w - 1,  # Qwen3.5's RMSNorm multiplies by (1 + w)
    "zero_gate_rows": _zero_gate_rows,
    "times_two": lambda w, D: w * 2,  # sigmoid(0) = 1/2 on the attention output, undone here exactly
}


def _head_dim(base: dict) -> int:
    return base.get("head_dim") or base["hidden_size"] // base["num_attention_heads"]


def check_exportable(cfg: HybridConfig, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming every option of `cfg` that Qwen3.5 cannot express exactly, and the fix."""
    base = cfg.base_config
    problems = []
    arch = base["model_type"]
    fix = "convert the teacher with `--target qwen3_5`"
    if arch == "gemma3_text":
        problems.append("a Gemma 3 teacher (sandwich norms, GELU MLP, embedding scale) has no Qwen3.5 form")
    elif arch != "qwen3":
        problems.append(f"the kept attention layers of a {arch} teacher have no q/k RMSNorm, which Qwen3.5's attention "
                        f"always applies: {fix}, which adds and aligns it")
    if base.get("hidden_act") != "silu":
        problems.append(f"hidden_act={base.get('hidden_act')!r}: Qwen3.5 uses SiLU (MLP and GDN conv)")
    if base.get("mlp_bias"):
        problems.append("mlp_bias=True: Qwen3.5's MLP has no bias")
    if base.get("final_logit_softcapping"):
        problems.append("final_logit_softcapping: Qwen3.5 has no logit softcap")
    kept = [i for i, t in enumerate(cfg.layer_types) if t != MIXER_TYPE]
    sliding = [i for i in kept if cfg.layer_types[i] == "sliding_attention"]
    if arch == "mistral" and base.get("sliding_window") is not None:
        sliding = kept
    if sliding:
        problems.append(f"kept attention layers {sliding} use a sliding window ({base.get('sliding_window')} tokens); "
                        "Qwen3.5's attention is full: set the teacher's sliding_window to null if it is not used")
    rope = base.get("rope_parameters") or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    if cfg.gdn_layers:
        spec = get_spec(cfg.mixer)
        if "qwen3_5" not in spec.exports:
            problems.append(f"its {cfg.mixer} layers have no Qwen3.5 form (Qwen3.5's linear layer is GDN)")
        else:
            problems += spec.export("qwen3_5")["problems"](spec.options(cfg.mixer_options), base, state,
                                                            cfg.gdn_layers, fix)
    if problems:
        raise ValueError("this hybrid cannot be exported exactly to qwen3_5:\n  - " + "\n  - ".join(problems))


def mrope_section(rotary_dim: int) -> list[int]:
    """Split the rotary frequencies (rotary_dim / 2) into the three multimodal sections Qwen3.5 configs carry. For
    text every section sees the same position, so the split does not change the model; engines check the sum."""
    half = rotary_dim // 2
    a = -(-half // 3)
    return [a, a, half - 2 * a]


def full_attention_interval(layer_types: list[str]) -> int | None:
    """k when the full-attention layers are exactly layers k-1, 2k-1, ... (Qwen3.5's own pattern), else None."""
    n = len(layer_types)
    for k in range(1, n + 1):
        if all((t != MIXER_TYPE) == ((i + 1) % k == 0) for i, t in enumerate(layer_types)):
            return k
    return None


def qwen3_5_config(cfg: HybridConfig, dtype: torch.dtype) -> dict:
    """The config.json of the exported model: Qwen3.5's fields, the layer pattern as `layer_types` and, when it is
    periodic, as the equivalent `full_attention_interval` (some engines read only that)."""
    base, spec = cfg.base_config, get_spec(cfg.mixer)
    D = _head_dim(base)
    rope = dict(base.get("rope_parameters") or {"rope_type": "default", "rope_theta": base.get("rope_theta", 10000.0)})
    rope.update(partial_rotary_factor=1.0, mrope_section=mrope_section(D), mrope_interleaved=True)
    types = ["linear_attention" if t == MIXER_TYPE else "full_attention" for t in cfg.layer_types]
    out = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": base["vocab_size"],
        "hidden_size": base["hidden_size"],
        "intermediate_size": base["intermediate_size"],
        "num_hidden_layers": base["num_hidden_layers"],
        "num_attention_heads": base["num_attention_heads"],
        "num_key_value_heads": base["num_key_value_heads"],
        "head_dim": D,
        "hidden_act": "silu",
        "max_position_embeddings": base["max_position_embeddings"],
        "rms_norm_eps": base["rms_norm_eps"],
        "tie_word_embeddings": bool(base.get("tie_word_embeddings", False)),
        "attention_bias": bool(base.get("attention_bias", False)),
        "qkv_bias": bool(base.get("attention_bias", False)),  # vLLM reads this (its o_proj never has a bias)
        "attn_output_gate": True,  # engines that read it default to True (vLLM) or False (others): say it
        "attention_dropout": 0.0,
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "partial_rotary_factor": 1.0,
        **spec.export("qwen3_5")["config"](spec.options(cfg.mixer_options)),
        "linear_key_head_dim": D,
        "linear_value_head_dim": D,
        "linear_num_key_heads": base["num_attention_heads"],
        "linear_num_value_heads": base["num_attention_heads"],
        "layer_types": types,
        "bos_token_id": base.get("bos_token_id"),
        "eos_token_id": base.get("eos_token_id"),
        "pad_token_id": base.get("pad_token_id"),
        "dtype": str(dtype).removeprefix("torch."),
    }
    interval = full_attention_interval(cfg.layer_types)
    if interval is not None:
        out["full_attention_interval"] = interval
    else:
        log.warning("the kept attention layers %s are not Qwen3.5's periodic pattern (layers k-1, 2k-1, ...): "
                    "transformers, vLLM and llama.cpp builds that read `layer_types` / recurrent_layers run it; "
                    "SGLang (which builds the pattern from full_attention_interval alone) cannot. For SGLang, "
                    "convert with --policy layers=<k-1, 2k-1, ...> (docs/serving.md)",
                    [i for i, t in enumerate(cfg.layer_types) if t != MIXER_TYPE])
    return out


def qwen3_5_state_dict(cfg: HybridConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> Qwen3.5's, through WEIGHT_MAP / ATTENTION_MAP / the mixer's map (its spec's "qwen3_5"
    export). Every key of ours is used once."""
    check_exportable(cfg, state)
    D = _head_dim(cfg.base_config)
    spec = get_spec(cfg.mixer)
    mixer_export, options = spec.export("qwen3_5"), spec.options(cfg.mixer_options)
    state = dict(state)
    if cfg.base_config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    for i in cfg.gdn_layers:
        mixer_export["prepare"](options, state, i)
    out, used = {}, set()

    def put(src, dst, transform, layer=None):
        srcs = (src,) if isinstance(src, str) else src
        names = [s.format(l=layer) for s in srcs]
        if not all(n in state for n in names):
            return
        w = torch.cat([state[n] for n in names], dim=0)
        out[dst.format(l=layer)] = (TRANSFORMS[transform](w, D) if transform else w).contiguous()
        used.update(names)

    for src, (dst, tf) in WEIGHT_MAP.items():
        for layer in (range(len(cfg.layer_types)) if "{l}" in src else [None]):
            put(src, dst, tf, layer)
    for layer, t in enumerate(cfg.layer_types):
        for src, (dst, tf) in (mixer_export["weights"] if t == MIXER_TYPE else ATTENTION_MAP).items():
            put(src, dst, tf, layer)
    if cfg.base_config.get("attention_bias"):  # Qwen3.5 gives every attention projection a bias when one has one
        for layer, t in enumerate(cfg.layer_types):
            key = f"model.layers.{layer}.self_attn.o_proj.bias"
            if t != MIXER_TYPE and key not in out:
                out[key] = torch.zeros(cfg.base_config["hidden_size"], dtype=out[f"model.layers.{layer}.self_attn."
                                                                                  "o_proj.weight"].dtype)
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"qwen3_5 export has no place for {left[:5]}{' ...' if len(left) > 5 else ''}")
    return out


def check_model_dir(path: Path) -> dict:
    """The config.json of a hybrid directory read as the loader reads it: the directory's JSON files regular files
    holding objects (a pipe would block the reader), the config the shape `convert` writes. Returns the config."""
    check_model_path(path)
    check_json_files(path, REWRITE)
    cfg = json.loads((path / "config.json").read_text())
    model_type = cfg.get("model_type")
    if model_type != HybridConfig.model_type:
        raise ValueError(f"{path} holds a {model_type!r} model, not a hybrid made by `convert` ({HybridConfig.model_type})")
    check_hybrid_config(path, cfg, REWRITE)
    check_tokenizer_files(path)
    return cfg


def _load_hybrid_files(path: Path) -> tuple[HybridConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    check_model_dir(path)
    files = check_safetensors(path, REWRITE)
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights; re-run `convert` to write them")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    try:
        cfg = HybridConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"could not read the config of {path}: {e}; {REWRITE}") from e
    check_state(path, cfg, state, REWRITE)
    return cfg, state


def _copy_tokenizer_and_generation(src: Path, dst: Path) -> None:
    """Tokenizer files and generation_config.json as saved by `convert` (copied, so nothing is re-encoded)."""
    names = [p for p in src.iterdir() if p.name.startswith(("tokenizer", "special_tokens_map", "vocab", "merges",
                                                            "chat_template", "added_tokens", "generation_config"))]
    for p in names:
        shutil.copy2(p, dst / p.name)


def export_qwen3_5(model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `out_dir`: config.json, model.safetensors, tokenizer and generation config of the Qwen3.5 form of the
    hybrid in `model_dir`. The directory appears complete or not at all; an existing one is never overwritten."""
    src, out = Path(model_dir), Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new --out (export never overwrites)")
    cfg, state = _load_hybrid_files(src)
    dtype = next(iter(state.values())).dtype
    weights = qwen3_5_state_dict(cfg, state)
    config = qwen3_5_config(cfg, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    try:
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_tokenizer_and_generation(src, tmp)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s -> %s (qwen3_5_text, %d layers: %s)", src, out, len(cfg.layer_types),
             "".join("G" if t == MIXER_TYPE else "A" for t in cfg.layer_types))
    return out


# --- `convert --target qwen3_5`: the teacher in the form Qwen3.5's attention takes ----------------------------------
QWEN3_FORM_FROM = ("llama", "qwen2", "mistral", "qwen3")


def target_gdn(gdn, teacher_config):
    """The GDN options `--target qwen3_5` builds (Qwen3.5's layer): returns the changed fields (logged, recorded)."""
    need = spec_for_options(gdn).export("qwen3_5")["options"](teacher_config)
    changed = {k: (getattr(gdn, k), v) for k, v in need.items() if getattr(gdn, k) != v}
    for k, (_, v) in changed.items():
        setattr(gdn, k, v)
    if changed:
        log.info("--target qwen3_5 sets GDN options %s", ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    return changed


def check_qwen3_form(tc) -> None:
    """Fail early (before statistics) when `--target qwen3_5` cannot take this teacher."""
    arch = tc.model_type
    if arch not in QWEN3_FORM_FROM:
        raise ValueError(f"--target qwen3_5 cannot take a {arch} teacher (Gemma 3: sandwich norms, GELU MLP and the "
                         f"embedding scale have no Qwen3.5 form); supported: {', '.join(QWEN3_FORM_FROM)}")
    if getattr(tc, "mlp_bias", False) or tc.hidden_act != "silu":
        raise ValueError(f"--target qwen3_5 needs a SiLU MLP without bias (teacher: hidden_act={tc.hidden_act!r}, "
                         f"mlp_bias={getattr(tc, 'mlp_bias', False)})")


@torch.no_grad()
def qwen3_form(teacher):
    """The teacher rebuilt as a Qwen3 model (Qwen3.5's attention without its gate, which export sets to a constant
    1/2): the same weights, plus q/k RMSNorm (unit weights here; `start_qk_norm` and alignment set them) and a zero
    o_proj bias where the teacher has q/k/v biases only. A Qwen3 teacher is returned as it is."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.initialization import no_init_weights

    from taylor_calibrate.model.hybrid import copy_buffers

    tc = teacher.config
    check_qwen3_form(tc)
    if tc.model_type == "qwen3":
        return teacher
    window = tc.sliding_window if tc.model_type == "mistral" or getattr(tc, "use_sliding_window", False) else None
    if window is not None:
        log.warning("--target qwen3_5: Qwen3.5 attention has no sliding window; the kept layers attend to the full "
                    "context instead of %d tokens (the same model on sequences up to that length)", window)
    attn0 = teacher.model.layers[0].self_attn
    cfg = Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=attn0.head_dim, hidden_act="silu",
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        rope_parameters=dict(tc.rope_parameters), tie_word_embeddings=tc.tie_word_embeddings,
        attention_bias=attn0.q_proj.bias is not None or attn0.o_proj.bias is not None, use_sliding_window=False,
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id)
    cfg._attn_implementation = getattr(tc, "_attn_implementation", None) or "sdpa"
    param = next(teacher.parameters())
    with no_init_weights(), torch.device(param.device):
        model = Qwen3ForCausalLM(cfg).to(param.dtype)
    missing, unexpected = model.load_state_dict(teacher.state_dict(), strict=False)
    for name in missing:
        p = model.get_parameter(name)
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            p.fill_(1.0)
        elif name.endswith("_proj.bias"):
            p.zero_()
        elif name != "lm_head.weight":
            raise RuntimeError(f"teacher -> Qwen3 form: no teacher weight for {name}")
    if unexpected:
        raise RuntimeError(f"teacher -> Qwen3 form: weights {unexpected[:5]} have no place")
    model.tie_weights()
    copy_buffers(teacher, model)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def spare_pair(attn, rotary, x: torch.Tensor) -> int:
    """The RoPE pair p (dims p and p + D/2 of every head) whose share of the logits the teacher's attention feels
    least: the attention-weighted variance over keys of the pair's logit term, summed over heads and queries (what
    dropping that term moves in the attention pattern, to second order). `attn`: the teacher's q/k projections
    (no q/k norm applied); x: (N, T, hidden) inputs."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    N, T, _ = x.shape
    D = attn.head_dim
    q = attn.q_proj(x).view(N, T, -1, D).transpose(1, 2)
    k = attn.k_proj(x).view(N, T, -1, D).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *rotary(x, torch.arange(T, device=x.device)[None]))
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    score = torch.zeros(D // 2, device=x.device)
    for h in range(q.shape[1]):  # one head at a time: (N, T, T) per pair
        qh, kh = q[:, h].float(), k[:, h].float()
        p = (qh @ kh.transpose(1, 2) * attn.scaling).masked_fill(future, -math.inf).softmax(-1)
        pq, pk = qh.view(N, T, 2, D // 2), kh.view(N, T, 2, D // 2)  # rotate_half pairs dims j and j + D/2
        for j in range(D // 2):
            term = torch.einsum("ntc,nsc->nts", pq[..., j], pk[..., j]) * attn.scaling
            mean = (p * term).sum(-1, keepdim=True)
            score[j] += (p * (term - mean) ** 2).sum(-1).mean()
    return int(score.argmin())


@torch.no_grad()
def start_qk_norm(attn, rotary, x: torch.Tensor) -> int:
    """Closed-form start for the q/k RMSNorm added to a kept attention layer; returns the RoPE pair it spends.

    Per-token normalisation would rescale each query's logits (its temperature) and each key's (the pattern). So one
    pair per head (`spare_pair`) gives up its content: its first dim carries a value b nearly constant over tokens (the
    projection row b * d, d the input direction with x.d = 1 on average, exactly on the first position, where later
    attention parks; the bias where the teacher has one: exact), its second dim 0. b is large enough (16 x the
    largest |q| on the rows) that the RMS is b's, the same for every token and head up to the spread of x.d and
    1/256 (bf16's resolution). The q norm's weight is 0 on the pair (its logit term vanishes whatever k holds there),
    the k norm's too, and elsewhere one least-squares scalar: the normed q and k are then the teacher's, rescaled."""
    D = attn.head_dim
    pair = spare_pair(attn, rotary, x[:2])
    xf = x.reshape(-1, x.shape[-1]).float()
    d = constant_direction(xf, anchor=x[:, 0].float().mean(0))
    spent = torch.zeros(D, dtype=torch.bool, device=x.device)
    spent[[pair, pair + D // 2]] = True
    for proj, norm in ((attn.q_proj, attn.q_norm), (attn.k_proj, attn.k_norm)):
        w = proj.weight.view(-1, D, proj.weight.shape[1])  # (heads, D, hidden)
        y = proj(xf.to(w)).float().view(xf.shape[0], -1, D)[..., ~spent]  # the teacher's q (k) without the pair
        b = 16 * y.pow(2).sum(-1).sqrt().max()
        w[:, spent] = 0
        if proj.bias is not None:
            proj.bias.view(-1, D)[:, spent] = 0
            proj.bias.view(-1, D)[:, pair] = b.to(proj.bias)
        else:
            w[:, pair] = (b * d).to(w)
        z = proj(xf.to(w)).float().view(xf.shape[0], -1, D)
        zn = (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))[..., ~spent]
        norm.weight.fill_((y * zn).sum() / zn.pow(2).sum())
        norm.weight[spent] = 0
    return pair
