"""The Gated DeltaNet mixer that replaces a converted attention layer (docs/method.md,
"The GDN layer").

Parameter names follow fla's `fla.layers.GatedDeltaNet` (q_proj, k_proj, v_proj, a_proj, b_proj, g_proj, o_proj,
A_log, dt_bias, q_conv1d/k_conv1d/v_conv1d, o_norm), so a state dict maps onto fla's layer and the recurrence can
run on fla's fused kernels. The recurrence itself lives in `taylor_calibrate.ops`.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from taylor_calibrate.model.mixers.gdn.config import GDNConfig
from taylor_calibrate.ops import gated_delta_rule, l2norm


class HeadRMSNorm(nn.Module):
    """RMSNorm over the head dim, weight shared by heads (fla's o_norm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):  # (..., D)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


_ACT = {"silu": F.silu, "identity": lambda x: x}
_GATE = {"swish": F.silu, "sigmoid": torch.sigmoid}


class GatedDeltaNet(nn.Module):
    """A GDN layer with the teacher's head layout: num_heads = teacher query heads, head_dim = teacher head_dim."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, cfg: GDNConfig, layer_idx: int,
                 qkv_bias: bool = False, o_bias: bool = False):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.num_heads, self.head_dim = num_heads, head_dim
        H, D = num_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, H * D, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, H * D, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, H * D, bias=qkv_bias)
        self.a_proj = nn.Linear(hidden_size, H, bias=False)  # decay input
        self.b_proj = nn.Linear(hidden_size, H, bias=False)  # write gate beta
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H))
        if cfg.short_conv != "none":  # depthwise causal convs, weight (C, 1, K) as fla's ShortConvolution
            for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
                setattr(self, name, nn.Conv1d(H * D, H * D, cfg.conv_size, groups=H * D, bias=False))
        self.g_proj = nn.Linear(hidden_size, H * D, bias=False) if cfg.gate != "none" else None
        self.o_norm = HeadRMSNorm(D, cfg.norm_eps) if cfg.output_norm else None
        self.o_proj = nn.Linear(H * D, hidden_size, bias=o_bias)
        self.backend = "torch"  # set once for the whole model by HybridForCausalLM.set_backend

    # --- pieces, exposed so calibration and alignment can read intermediate quantities -------------------------
    def _qkv(self, x):
        """q|k|v (B, T, 3C), concatenating whichever is smaller: for more tokens than hidden units (prefill,
        training) one matmul over the three projections' rows (a wider GEMM, no concatenation of activations forward
        or backward), for fewer (decoding) the three projections' outputs."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if x[..., 0].numel() <= x.shape[-1]:
            return torch.cat([p(x) for p in projs], dim=-1)
        bias = None if self.q_proj.bias is None else torch.cat([p.bias for p in projs])
        return F.linear(x, torch.cat([p.weight for p in projs]), bias)

    def _conv(self, x, cache):
        """Causal depthwise conv over the q|k|v channels of x (B, T, 3C); the cache keeps the last K-1 inputs for
        decoding. Written as K shifted products (summed in fp32 at least) rather than `F.conv1d`: the same sums, and
        under torch.compile one fused pointwise kernel with what follows (activation, l2norm), forward and backward,
        where a depthwise convolution is an opaque library call with a slow weight gradient."""
        T, K = x.shape[1], self.cfg.conv_size
        if cache is not None:
            x = cache.update_conv_state(x.transpose(1, 2), self.layer_idx, conv_kernel_size=K - 1).transpose(1, 2)
        acc = torch.promote_types(x.dtype, torch.float32)  # bf16 inputs sum in fp32, fp64 stays fp64
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], dim=0)[:, 0].to(acc)
        xp = F.pad(x, (0, 0, K - 1, 0))  # (B, S + K - 1, 3C): output t reads inputs t - K + 1 .. t
        S = xp.shape[1] - (K - 1)
        return sum(xp[:, S - T + j:S + j].to(acc) * w[:, j] for j in range(K)).to(x.dtype)

    def _short_conv(self, q, k, v, cache):
        """`_conv` of q, k, v given apart: (q, k, v) after the conv."""
        return self._conv(torch.cat([q, k, v], dim=-1), cache).split(q.shape[-1], dim=-1)

    def features(self, x, cache=None, gdn_mask=None):
        """Inputs of the recurrence: q, k, v (B, T, H, D), log-decay g and write gate beta (B, T, H), both fp32."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        qkv = self._qkv(x)
        if gdn_mask is not None:  # padded positions neither write nor decay: left padding becomes invisible
            qkv = qkv * gdn_mask[:, -T:, None].to(qkv.dtype)
        if self.cfg.short_conv != "none":
            qkv = self._conv(qkv, cache)
        q, k, v = qkv.split(H * D, dim=-1)
        q = _ACT[self.cfg.qk_activation](q).view(B, T, H, D)
        k = _ACT[self.cfg.qk_activation](k).view(B, T, H, D)
        v = _ACT[self.cfg.v_activation](v).view(B, T, H, D)
        q, k = l2norm(q.float()).to(v.dtype), l2norm(k.float()).to(v.dtype)  # fla's (and Qwen3.5's) formula
        beta = torch.sigmoid(self.b_proj(x).float())  # (B, T, H)
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())  # log gamma
        if gdn_mask is not None:
            keep = gdn_mask[:, -T:, None].to(beta.dtype)
            beta, g = beta * keep, g * keep
        return q, k, v, g, beta

    def readout(self, q, k, v, g, beta, cache=None):
        """Run the recurrence (chunked for prefill, step-wise for decode) and keep the state in the cache."""
        state = None
        if cache is not None:
            layer = cache.layers[self.layer_idx]
            if layer.is_recurrent_states_initialized[0]:
                state = layer.recurrent_states[0]
        o, final = gated_delta_rule(q, k, v, g, beta, scale=self.head_dim ** -0.5, initial_state=state,
                                    output_final_state=cache is not None, backend=self.backend)
        if cache is not None:
            cache.update_recurrent_state(final, self.layer_idx)
        return o  # (B, T, H, D)

    def gate(self, x, o):
        """Per-head norm and output gate, before o_proj: (B, T, H, D) -> (B, T, H, D)."""
        if self.o_norm is not None:
            o = self.o_norm(o)
        if self.g_proj is not None:
            B, T, _ = x.shape
            o = o * _GATE[self.cfg.gate](self.g_proj(x).view(B, T, self.num_heads, self.head_dim)).to(o.dtype)
        return o

    def output(self, x, o):
        """The layer's output from the recurrence's: gate, then o_proj. (B, T, H, D) -> (B, T, hidden)."""
        B, T = x.shape[:2]
        return self.o_proj(self.gate(x, o).reshape(B, T, -1))

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, gdn_mask=None, **kwargs):
        """Same call signature as the teacher's attention module (masks and RoPE are ignored: position lives
        in the decay; padding comes in as the 2-D `gdn_mask` the hybrid model passes down)."""
        x = hidden_states
        q, k, v, g, beta = self.features(x, cache, gdn_mask)
        return self.output(x, self.readout(q, k, v, g, beta, cache)), None


# --- weight transfer and the library-default init ("copy", docs/method.md, "Weight transfer") ------------
def _repeat_heads(w: torch.Tensor, num_kv: int, groups: int) -> torch.Tensor:
    """(Hkv*D, ...) -> (Hkv*groups*D, ...): every query head h gets key/value head h // groups (GQA)."""
    return w.reshape(num_kv, -1, *w.shape[1:]).repeat_interleave(groups, dim=0).reshape(-1, *w.shape[1:])


@torch.no_grad()
def copy_attention_weights(gdn: GatedDeltaNet, attn: nn.Module, num_kv_heads: int) -> None:
    """q_proj <- W_Q, o_proj <- W_O, k/v_proj <- W_K/W_V with GQA heads repeated; biases carried (Qwen2) unless
    the GDN option `bias` is off; a teacher's per-head q/k norm factor folded into q/k_proj (`qk_norm` fold)."""
    groups = gdn.num_heads // num_kv_heads
    gdn.q_proj.weight.copy_(attn.q_proj.weight)
    gdn.o_proj.weight.copy_(attn.o_proj.weight)
    for name in ("k_proj", "v_proj"):
        getattr(gdn, name).weight.copy_(_repeat_heads(getattr(attn, name).weight, num_kv_heads, groups))
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        src, dst = getattr(attn, name).bias, getattr(gdn, name).bias
        if dst is None and not gdn.cfg.bias:  # a bias-free GDN (--target qwen3_5) drops the teacher's biases
            continue
        if (src is None) != (dst is None):
            raise ValueError(f"{name} bias mismatch between teacher attention and GDN layer")
        if src is not None:
            dst.copy_(src if name in ("q_proj", "o_proj") else _repeat_heads(src, num_kv_heads, groups))
    if gdn.cfg.qk_norm == "fold":
        for proj, norm in (("q_proj", "q_norm"), ("k_proj", "k_norm")):
            scale = qk_norm_scale(getattr(attn, norm, None), gdn.head_dim)
            if scale is not None:
                lin = getattr(gdn, proj)
                lin.weight.view(gdn.num_heads, gdn.head_dim, -1).mul_(scale.to(lin.weight.dtype)[None, :, None])
                if lin.bias is not None:
                    lin.bias.view(gdn.num_heads, gdn.head_dim).mul_(scale.to(lin.bias.dtype))


def qk_norm_scale(norm: nn.Module | None, head_dim: int) -> torch.Tensor | None:
    """The per-channel factor of a teacher's per-head q or k RMSNorm (Qwen3: w, Gemma 3: 1 + w), read off the module
    itself on a unit vector; None where the attention has none. After the norm a query or key is that factor times a
    unit-RMS vector, so the factor sets the direction the attention scores compare, which a later L2 normalisation
    keeps only when it is folded into the projection (method.md, "Weight transfer")."""
    if norm is None:
        return None
    w = getattr(norm, "weight", None)
    if w is None or w.shape != (head_dim,):
        raise ValueError(f"the teacher's q/k norm {type(norm).__name__} is not per head channel (weight "
                         f"{None if w is None else tuple(w.shape)}, head_dim {head_dim}): set --gdn.qk_norm drop")
    return norm(torch.ones(head_dim, dtype=torch.float32, device=w.device)).float()


@torch.no_grad()
def identity_conv_(conv: nn.Conv1d) -> None:
    """A causal conv that passes its input through: weight 1 on the current token (last tap), 0 elsewhere."""
    conv.weight.zero_()
    conv.weight[..., -1] = 1.0


@torch.no_grad()
def init_recurrent_defaults(gdn: GatedDeltaNet, generator: torch.Generator) -> None:
    """fla's default init of the new parameters: A ~ U(0, 16), dt ~ logU(1e-3, 1e-1) through softplus^-1,
    xavier-uniform(gain 2^-2.5) gates, identity or default conv, unit o_norm."""
    dev = gdn.A_log.device

    def rand(*shape):
        return torch.rand(*shape, generator=generator).to(dev)

    H = gdn.num_heads
    gdn.A_log.copy_(torch.log(rand(H) * 16).clamp_min(-20.0))
    dt = torch.exp(rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp_min(1e-4)
    gdn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    for lin in (gdn.a_proj, gdn.b_proj, gdn.g_proj):
        if lin is not None:
            fan_out, fan_in = lin.weight.shape
            bound = 2 ** -2.5 * math.sqrt(6.0 / (fan_in + fan_out))
            lin.weight.copy_((rand(*lin.weight.shape) * 2 - 1) * bound)
    if gdn.cfg.short_conv != "none":
        for conv in (gdn.q_conv1d, gdn.k_conv1d, gdn.v_conv1d):
            if gdn.cfg.short_conv == "identity":
                identity_conv_(conv)
            else:  # nn.Conv1d's default: U(-1/sqrt(K), 1/sqrt(K)) for depthwise
                bound = 1 / math.sqrt(conv.weight.shape[-1])
                conv.weight.copy_((rand(*conv.weight.shape) * 2 - 1) * bound)
    if gdn.o_norm is not None:
        gdn.o_norm.weight.fill_(1.0)


def build(hidden_size: int, num_heads: int, head_dim: int, cfg: GDNConfig, layer_idx: int, qkv_bias: bool,
          o_bias: bool) -> GatedDeltaNet:
    """A new GDN layer; the teacher's q/k/v/o biases are carried only when the option `bias` is on."""
    return GatedDeltaNet(hidden_size, num_heads, head_dim, cfg, layer_idx, qkv_bias=cfg.bias and qkv_bias,
                         o_bias=cfg.bias and o_bias)


def state_bytes(cfg: GDNConfig, H: int, D: int, element_size: int) -> int:
    """Bytes of one sequence's decoding state of H heads in one layer: the fp32 (H, D, D) recurrent state (fla and the
    torch path keep it in fp32) plus the short conv's last K-1 inputs of q|k|v (`element_size` bytes each)."""
    conv = 0 if cfg.short_conv == "none" else 3 * H * D * (cfg.conv_size - 1) * element_size
    return H * D * D * 4 + conv
