"""Per-query statistics of causal softmax attention (docs/method.md,
"Teacher statistics"), in pure PyTorch.

For every query t of every head, from the teacher's attention probabilities p_ts (causal, optional sliding window
W: key s visible iff 0 <= t - s < W, optional tanh softcap of the scores):

    entropy  H_t = -sum_s p_ts log p_ts        distance  E[t-s] = sum_s p_ts (t - s)
    diag     p_tt                              sink      p_t0
    lse      log sum_s e^(score_ts): any single p_ts = exp(score_ts - lse_t) afterwards (`band_probs`)
    lse_nosink  the same over keys s >= 1 (NaN at t = 0): the sink-dropped p'_ts = exp(score_ts - lse_nosink_t)
    entropy_nosink, distance_nosink: the same with key 0's mass removed and the row renormalised (NaN at t = 0)

`attention_stats` streams over key blocks with online-softmax accumulators (running max m, l = sum e^(x-m),
A = sum e^(x-m)(x-m), B = sum e^(x-m)(t-s); H = log l - A/l, E[t-s] = B/l): O(T) memory per head, never the
T x T matrix. It is the CPU implementation and the reference of the Triton kernel (attention_stats_triton.py).
`attention_stats_naive` materialises the probabilities in fp64: the reference of both, small T only.
"""
from __future__ import annotations

import math

import torch

OUTPUTS = ("entropy", "distance", "diag", "sink", "entropy_nosink", "distance_nosink", "lse", "lse_nosink")


def check_inputs(q: torch.Tensor, k: torch.Tensor, window: int | None, softcap: float | None) -> int:
    """Shapes and options every implementation accepts; returns the GQA group size H // Hkv."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"attention statistics take q (B, H, T, D) and k (B, Hkv, T, D), got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    (B, H, T, D), (Bk, Hkv, Tk, Dk) = q.shape, k.shape
    if (B, T, D) != (Bk, Tk, Dk) or Hkv < 1 or H % Hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, length and head dim, and k's "
                         "heads must divide q's (GQA)")
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 (or None), got {window}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be > 0 (or None / 0 for none), got {softcap}")
    return H // Hkv


def expand_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv*groups, T, D): query head h reads key head h // groups (transformers' repeat_kv)."""
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _scores(q, k, scale, softcap):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return torch.tanh(s / softcap) * softcap if softcap else s


def attention_stats(q, k, scale: float, window: int | None = None, softcap: float | None = None,
                    block: int = 256) -> dict[str, torch.Tensor]:
    """Per-query statistics of causal softmax attention, streamed over key blocks.

    q: (B, H, T, D), k: (B, Hkv, T, D) with Hkv dividing H (GQA; expanded here). Returns (B, H, T) fp32 tensors:
    `entropy`, `distance` (E[t-s]), `diag` (p_tt), `sink` (p_t0), and their sink-dropped versions
    `entropy_nosink`, `distance_nosink` (mass on key 0 removed, rows renormalised; NaN at t = 0), and `lse` /
    `lse_nosink` (the row's log-normaliser over all keys / keys s >= 1). `window` = sliding window W (key s visible iff 0 <= t - s < W), as transformers defines it.
    """
    k = expand_kv(k, check_inputs(q, k, window, softcap))
    B, H, T, _ = q.shape
    q, k = q.float(), k.float()
    pos = torch.arange(T, device=q.device)
    out = {n: torch.empty(B, H, T, device=q.device) for n in OUTPUTS}
    for i0 in range(0, T, block):
        i1 = min(i0 + block, T)
        qb, tq = q[:, :, i0:i1], pos[i0:i1, None]  # (B, H, Bq, D), (Bq, 1)
        m = torch.full((B, H, i1 - i0), -math.inf, device=q.device)
        l, A, Bd = (torch.zeros_like(m) for _ in range(3))
        j_start = 0 if window is None else max(0, i0 - window + 1) // block * block
        for j0 in range(j_start, i1, block):
            j1 = min(j0 + block, T)
            s = _scores(qb, k[:, :, j0:j1], scale, softcap)  # (B, H, Bq, Bk)
            dist = (tq - pos[None, j0:j1]).float()  # (Bq, Bk) = t - s
            visible = dist >= 0
            if window is not None:
                visible &= dist < window
            s = s.masked_fill(~visible, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))  # the max includes the sink key, for stability
            r = torch.exp(m - m_new).nan_to_num(0.0)  # rescale old sums; 0 where m was -inf
            m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet stay at 0
            summed = visible & (pos[None, j0:j1] > 0)  # sums skip key 0: its term is added back exactly below
            p = torch.where(summed, torch.exp(s - m_safe[..., None]), 0.0)
            centred = torch.where(summed, s - m_safe[..., None], 0.0)
            A = r * (A + l * (m - m_new).nan_to_num(0.0)) + (p * centred).sum(-1)
            l = r * l + p.sum(-1)
            Bd = r * Bd + (p * dist).sum(-1)
            m = m_new
        # diagonal and sink scores, computed directly (one dot product each per query)
        s_diag = _scores(qb.unsqueeze(-2), k[:, :, i0:i1].unsqueeze(-2), scale, softcap)[..., 0, 0]
        s_sink = _scores(qb, k[:, :, :1], scale, softcap)[..., 0]
        e_sink = torch.exp(s_sink - m)
        if window is not None:
            e_sink = torch.where(tq[:, 0] < window, e_sink, 0.0)
        t = tq[:, 0].float()
        lf, Af, Bf = l + e_sink, A + e_sink * (s_sink - m), Bd + e_sink * t  # all keys = non-sink keys + key 0
        sl = slice(i0, i1)
        out["entropy"][:, :, sl] = torch.log(lf) - Af / lf
        out["distance"][:, :, sl] = Bf / lf
        out["diag"][:, :, sl] = torch.exp(s_diag - m) / lf
        out["sink"][:, :, sl] = e_sink / lf
        out["entropy_nosink"][:, :, sl] = torch.log(l) - A / l  # NaN at t = 0 (no non-sink key)
        out["distance_nosink"][:, :, sl] = Bd / l
        out["lse"][:, :, sl] = m + torch.log(lf)
        out["lse_nosink"][:, :, sl] = m + torch.log(l)
    out["entropy_nosink"][:, :, 0] = math.nan
    out["distance_nosink"][:, :, 0] = math.nan
    out["lse_nosink"][:, :, 0] = math.nan
    return out


def attention_stats_naive(q, k, scale: float, window: int | None = None, softcap: float | None = None):
    """Reference for `attention_stats`: the full T x T probability matrix in fp64 (small T only)."""
    k = expand_kv(k, check_inputs(q, k, window, softcap))
    T = q.shape[2]
    s = _scores(q.double(), k.double(), scale, softcap)
    pos = torch.arange(T, device=q.device)
    dist = (pos[:, None] - pos[None, :]).double()
    visible = dist >= 0
    if window is not None:
        visible &= dist < window
    p = torch.softmax(s.masked_fill(~visible, -math.inf), -1)
    plogp = torch.where(p > 0, p * torch.log(p.clamp_min(1e-300)), 0.0)
    p0 = p[..., 1:].clone()
    p0 = p0 / p0.sum(-1, keepdim=True)  # row 0 has no non-sink key: NaN, as in the streamed version
    plogp0 = torch.where(p0 > 0, p0 * torch.log(p0.clamp_min(1e-300)), 0.0)
    out = {"entropy": -plogp.sum(-1), "distance": (p * dist).sum(-1), "diag": p.diagonal(dim1=-2, dim2=-1),
           "sink": p[..., 0], "entropy_nosink": -plogp0.sum(-1), "distance_nosink": (p0 * dist[:, 1:]).sum(-1),
           "lse": torch.logsumexp(s.masked_fill(~visible, -math.inf), -1),
           "lse_nosink": torch.logsumexp(s[..., 1:].masked_fill(~visible[:, 1:], -math.inf), -1)}
    out["entropy_nosink"][..., 0] = math.nan
    out["distance_nosink"][..., 0] = math.nan
    out["lse_nosink"][..., 0] = math.nan
    return {k_: v.float() for k_, v in out.items()}


def band_probs(q, k, lse: torch.Tensor, scale: float, width: int, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
    """p_{t, t-j} for the `width` nearest offsets j = 0..width-1 of every query, from its log-normaliser `lse` (an
    output of `attention_stats`; (..., B, H, T): several normalisers, e.g. with and without the sink, share the
    scores): (..., B, H, T, width) fp32, 0 where key t-j does not exist or is outside the window. `width` dot
    products per query: the local attention profile that phase 1 puts into the short conv on v."""
    k = expand_kv(k, check_inputs(q, k, window, softcap))
    T = q.shape[2]
    q, k = q.float(), k.float()
    out = torch.zeros(*lse.shape, width, device=q.device)
    for j in range(min(width, T) if window is None else min(width, T, window)):
        s = _scores(q[:, :, j:].unsqueeze(-2), k[:, :, :T - j].unsqueeze(-2), scale, softcap)[..., 0, 0]
        out[..., j:, j] = torch.exp(s - lse[..., j:])
    return out
