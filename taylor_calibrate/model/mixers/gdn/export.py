"""How a GDN layer maps onto Qwen3.5's `linear_attn` (the format itself: taylor_calibrate.export.qwen3_5):

    GDN layer (fla names)              Qwen3.5 `linear_attn`
    q_proj | k_proj | v_proj       ->  in_proj_qkv (rows concatenated)
    q_conv1d | k_conv1d | v_conv1d ->  conv1d, SiLU after it on q|k|v (no conv: the identity kernel)
    g_proj, b_proj, a_proj         ->  in_proj_z, in_proj_b, in_proj_a
    A_log, dt_bias                 ->  A_log, dt_bias
    o_norm (weight w)              ->  norm (gated RMSNorm, SiLU gate, weight w)
    o_proj                         ->  out_proj

The GDN must then use SiLU on q, k and v, a swish output gate after the per-head norm, no q/k/v bias, and the
model's RMSNorm epsilon (`qwen3_5_options`, which `convert --target qwen3_5` builds; `qwen3_5_problems` names what is
not so)."""
from __future__ import annotations

import math

import torch

from taylor_calibrate.model.mixers.gdn.config import GDNConfig

# Our key -> Qwen3.5's key, as qwen3_5.WEIGHT_MAP: `{l}` is the layer index, tuples are concatenated along dim 0.
QWEN3_5_MAP = {
    ("model.layers.{l}.self_attn.q_proj.weight", "model.layers.{l}.self_attn.k_proj.weight",
     "model.layers.{l}.self_attn.v_proj.weight"): ("model.layers.{l}.linear_attn.in_proj_qkv.weight", None),
    ("model.layers.{l}.self_attn.q_conv1d.weight", "model.layers.{l}.self_attn.k_conv1d.weight",
     "model.layers.{l}.self_attn.v_conv1d.weight"): ("model.layers.{l}.linear_attn.conv1d.weight", None),
    "model.layers.{l}.self_attn.g_proj.weight": ("model.layers.{l}.linear_attn.in_proj_z.weight", None),
    "model.layers.{l}.self_attn.b_proj.weight": ("model.layers.{l}.linear_attn.in_proj_b.weight", None),
    "model.layers.{l}.self_attn.a_proj.weight": ("model.layers.{l}.linear_attn.in_proj_a.weight", None),
    "model.layers.{l}.self_attn.A_log": ("model.layers.{l}.linear_attn.A_log", None),
    "model.layers.{l}.self_attn.dt_bias": ("model.layers.{l}.linear_attn.dt_bias", None),
    "model.layers.{l}.self_attn.o_norm.weight": ("model.layers.{l}.linear_attn.norm.weight", None),
    "model.layers.{l}.self_attn.o_proj.weight": ("model.layers.{l}.linear_attn.out_proj.weight", None),
}


def qwen3_5_options(teacher_config) -> dict:
    """The GDN options of Qwen3.5's layer (what `--target qwen3_5` builds)."""
    return dict(qk_activation="silu", v_activation="silu", gate="swish", output_norm=True, bias=False,
                norm_eps=teacher_config.rms_norm_eps)


def qwen3_5_problems(cfg: GDNConfig, base: dict, state: dict, layers: list[int], fix: str) -> list[str]:
    """What of these GDN layers Qwen3.5's cannot express exactly, each with the fix."""
    problems = []
    wrong = {"qk_activation": "silu", "v_activation": "silu", "gate": "swish", "output_norm": True}
    for name, need in wrong.items():
        if getattr(cfg, name) != need:
            problems.append(f"--gdn.{name}={getattr(cfg, name)!r}: Qwen3.5's GDN needs {need!r} ({fix}, which "
                            "sets it)")
    if not math.isclose(cfg.norm_eps, base["rms_norm_eps"], rel_tol=1e-6):
        problems.append(f"--gdn.norm_eps={cfg.norm_eps} differs from the teacher's rms_norm_eps "
                        f"{base['rms_norm_eps']}, which Qwen3.5 uses for the GDN norm too ({fix}, which sets it)")
    biased = [i for i in layers if any(f"model.layers.{i}.self_attn.{p}_proj.bias" in state
                                       for p in ("q", "k", "v", "o"))]
    if biased:
        problems.append(f"GDN layers {biased} have q/k/v/o biases (a Qwen2 teacher's); Qwen3.5's GDN has none "
                        f"({fix}, which builds them without)")
    return problems


def qwen3_5_prepare(cfg: GDNConfig, state: dict, layer: int) -> None:
    """No conv: Qwen3.5 always convolves, so pass the input through (weight 1 on the last tap); in place."""
    if f"model.layers.{layer}.self_attn.q_conv1d.weight" not in state:
        q = state[f"model.layers.{layer}.self_attn.q_proj.weight"]
        w = torch.zeros(q.shape[0], 1, cfg.conv_size, dtype=q.dtype)
        w[..., -1] = 1.0
        for p in "qkv":
            state[f"model.layers.{layer}.self_attn.{p}_conv1d.weight"] = w


def qwen3_5_config(cfg: GDNConfig) -> dict:
    """Qwen3.5 config fields these options set."""
    return {"linear_conv_kernel_dim": cfg.conv_size}


QWEN3_5 = dict(weights=QWEN3_5_MAP, options=qwen3_5_options, problems=qwen3_5_problems, prepare=qwen3_5_prepare,
               config=qwen3_5_config)
