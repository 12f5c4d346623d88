"""A test-only second mixer: gated linear attention with one scalar decay per head and token, reference ops only.

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,   o_t = scale * q_t^T S_t,   g_t = logsigmoid(a_proj(x_t) + decay_bias)

It exists to show that a mixer plugs in through its spec alone: tests register TOY_SPEC in MIXERS and run it
through conversion, phase 1, phase 2, save, load and cached generation on the same code path as GDN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from taylor_calibrate.model.mixers.calibration import distance
from taylor_calibrate.model.mixers.spec import MixerSpec


@dataclass
class ToyConfig:
    """Options of the toy layer."""

    bias: bool = True
    """Carry the teacher's projection biases."""

    @classmethod
    def from_dict(cls, d: dict | None) -> "ToyConfig":
        d = dict(d or {})
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown toy option(s) {sorted(unknown)}")
        return cls(**d)


def recurrence(q, k, v, g, scale, state=None):
    """The reference recurrence, one token at a time: (B, T, H, D) inputs, (B, T, H) log decay -> o, final state."""
    B, T, H, D = q.shape
    S = torch.zeros(B, H, D, v.shape[-1], dtype=torch.float32, device=q.device) if state is None else state
    out = []
    for t in range(T):
        S = S * g[:, t, :, None, None].exp() + k[:, t].float()[..., None] * v[:, t].float()[..., None, :]
        out.append(torch.einsum("bhd,bhde->bhe", q[:, t].float() * scale, S))
    return torch.stack(out, 1).to(v.dtype), S


class ToyGLA(nn.Module):
    """The toy layer, with the mixer protocol's features / readout / output (model/mixers/spec.py)."""

    def __init__(self, hidden_size, num_heads, head_dim, cfg: ToyConfig, layer_idx, qkv_bias=False, o_bias=False):
        super().__init__()
        self.cfg, self.layer_idx, self.num_heads, self.head_dim = cfg, layer_idx, num_heads, head_dim
        H, D = num_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, H * D, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, H * D, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, H * D, bias=qkv_bias)
        self.a_proj = nn.Linear(hidden_size, H, bias=False)
        self.decay_bias = nn.Parameter(torch.zeros(H))
        self.o_proj = nn.Linear(H * D, hidden_size, bias=o_bias)
        self.backend = "torch"

    def features(self, x, cache=None, gdn_mask=None):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = F.normalize(q.float(), dim=-1).to(v.dtype), F.normalize(k.float(), dim=-1).to(v.dtype)
        g = F.logsigmoid(self.a_proj(x).float() + self.decay_bias.float())
        if gdn_mask is not None:  # padded positions neither write nor decay
            m = gdn_mask[:, -T:].to(g.dtype)
            k, g = k * m[..., None, None].to(k.dtype), g * m[..., None]
        return q, k, v, g

    def readout(self, q, k, v, g, cache=None):
        state = None
        if cache is not None and cache.layers[self.layer_idx].is_recurrent_states_initialized[0]:
            state = cache.layers[self.layer_idx].recurrent_states[0]
        o, final = recurrence(q, k, v, g, self.head_dim ** -0.5, state)
        if cache is not None:
            cache.update_recurrent_state(final, self.layer_idx)
        return o

    def output(self, x, o):
        return self.o_proj(o.reshape(*x.shape[:2], -1))

    def forward(self, hidden_states, cache=None, gdn_mask=None, **kwargs):
        x = hidden_states
        return self.output(x, self.readout(*self.features(x, cache, gdn_mask), cache=cache)), None


def build(hidden_size, num_heads, head_dim, cfg, layer_idx, qkv_bias, o_bias):
    return ToyGLA(hidden_size, num_heads, head_dim, cfg, layer_idx, cfg.bias and qkv_bias, cfg.bias and o_bias)


@torch.no_grad()
def copy_from_attention(mixer, attn, num_kv):
    """W_Q, W_K, W_V, W_O (and biases), key/value heads repeated for GQA."""
    groups = mixer.num_heads // num_kv

    def rep(w):
        return w.reshape(num_kv, -1, *w.shape[1:]).repeat_interleave(groups, 0).reshape(-1, *w.shape[1:])

    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        src, dst = getattr(attn, name), getattr(mixer, name)
        f = rep if name in ("k_proj", "v_proj") else (lambda w: w)
        dst.weight.copy_(f(src.weight))
        if dst.bias is not None and src.bias is not None:
            dst.bias.copy_(f(src.bias))


@torch.no_grad()
def init_weights(mixer, generator):
    """Small random decay input, a half-life of about 8 tokens."""
    w = mixer.a_proj.weight
    w.copy_((torch.rand(w.shape, generator=generator) * 2 - 1).to(w) * 0.01)
    mixer.decay_bias.fill_(math.log(2 ** (-1 / 8) / (1 - 2 ** (-1 / 8))))


def _copy(mixer, st, x, y, args):
    return {}


@torch.no_grad()
def _half_life(mixer, st, x, y, args):
    """The decay's half-life set to the teacher's mean attention distance d_h (a_proj = 0)."""
    d = distance(st).to(mixer.decay_bias.device)
    gamma = 2 ** (-1 / d)
    mixer.a_proj.weight.zero_()
    mixer.decay_bias.copy_(torch.log(gamma / (1 - gamma)))
    return {"half_life": d.tolist()}


def state_bytes(options, num_heads, head_dim, element_size):
    return num_heads * head_dim * head_dim * 4


TOY_SPEC = MixerSpec(
    name="toy", config=ToyConfig, module=ToyGLA, build=build, copy_from_attention=copy_from_attention,
    init_weights=init_weights, calibrators={"copy": _copy, "half_life": _half_life},
    param_groups={"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "a_proj": "dynamics",
                  "decay_bias": "dynamics", "o_proj": "o_proj"},
    state_bytes=state_bytes, kernels={("torch", "recurrent"): recurrence},
)
