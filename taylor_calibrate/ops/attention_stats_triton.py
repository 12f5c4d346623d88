"""Attention statistics in one flash-attention-style Triton pass per layer (docs/method.md,
"Teacher statistics").

Same outputs as `attention_stats` in attention_stats_torch.py (its reference; tests/test_attention_stats_kernel.py holds
the two together): per head and query, entropy, E[t-s], p_tt, p_t0 and the sink-dropped entropy / E[t-s], without
the T x T matrix. One program owns BLOCK_M queries of one (batch, head) and walks the visible key blocks once with
online-softmax accumulators, all fp32:

    m = running max,  l = sum e^(x-m),  A = sum e^(x-m) (x-m),  B = sum e^(x-m) (t-s)
    H = log l - A/l,  E[t-s] = B/l

Speed, as flash-attention's forward gets it: scores are kept in log2 units so the loop's exponentials are exp2 (m and A
are converted back once at the end); only the edge key blocks (key 0's, the window's lower edge, the diagonal) pay for
masks, the bulk of the blocks run unmasked; and the tiles are autotuned per (head dim, length) on a GPU.

One difference from the torch streaming path, on purpose: the loop sums the keys s >= 1 only, with their own running
max, and key 0 (the attention sink) is folded in at the end, exactly as a single extra term. The sink-dropped
statistics are then read straight off the loop's accumulators (H' = log l - A/l, E'[t-s] = B/l) and stay exact even
when the sink out-scores every other key by more than fp32's exp range (where the torch path, whose running max
includes the sink, underflows to NaN; see the xfail test in tests/test_stats.py).

GQA: k keeps its Hkv heads; query head h reads key head h // (H // Hkv) inside the kernel (no expanded copy).
Importing this module needs triton; the dispatcher (ops/__init__.py) imports it only when it picks this backend.
On a CPU, the kernel runs under Triton's interpreter only (TRITON_INTERPRET=1 before import): that is for tests.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .attention_stats_torch import OUTPUTS, check_inputs


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    """tanh from exp (portable across Triton versions and the interpreter); exact limits +-1 at large |x|."""
    e = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -y, y)


@triton.jit
def _scores(q, k, scale, softcap, HAS_SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Scores of a (BLOCK_M, BLOCK_N) tile in log2 units (x * log2 e), so the loop can use exp2."""
    if IEEE:  # fp32 inputs: full-precision products, as the torch path (not TF32)
        x = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:  # bf16 / fp16: exact products accumulated in fp32 on the tensor cores
        x = tl.dot(q, tl.trans(k))
    if HAS_SOFTCAP:
        return _tanh(x * (scale / softcap)) * (softcap * LOG2E)
    return x * (scale * LOG2E)


@triton.jit
def _key_block(q, k_base, stride_kt, stride_kd, start_n, rows, cols0, dims, dim_ok, m_i, l_i, a_i, d_i,
               T, scale, softcap, window,
               MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
    """One key block into the running sums (log2 units: m and A scale by ln 2 at the end, l and B do not).

    Unmasked blocks (every key visible to every query of the block, none of them key 0) skip the masks and take
    sum p (t-s) as (t - start_n) sum p - sum p c, c = the key's offset in the tile: small integers, exact in fp32."""
    neg_inf = float("-inf")
    cols = start_n + cols0
    if MASKED:
        k = tl.load(k_base + cols[:, None] * stride_kt + dims[None, :] * stride_kd,
                    mask=(cols[:, None] < T) & dim_ok[None, :], other=0.0)
    else:
        k = tl.load(k_base + cols[:, None] * stride_kt + dims[None, :] * stride_kd, mask=dim_ok[None, :], other=0.0)
    x = _scores(q, k, scale, softcap, HAS_SOFTCAP, IEEE)
    if MASKED:
        dist = rows[:, None] - cols[None, :]  # t - s (int32, exact)
        keep = (dist >= 0) & (cols[None, :] >= 1) & (cols[None, :] < T)  # key 0 is folded in after the loop
        if HAS_WINDOW:
            keep = keep & (dist < window)
        x = tl.where(keep, x, neg_inf)
    m_new = tl.maximum(m_i, tl.max(x, 1))
    m_ref = tl.where(m_new == neg_inf, 0.0, m_new)  # rows with no visible key yet keep zero sums
    r = tl.exp2(m_i - m_ref)  # rescales the old sums; 0 while m_i is -inf
    shift = tl.where(m_i == neg_inf, 0.0, m_i - m_ref)
    xc = x - m_ref[:, None]
    if MASKED:
        xc = tl.where(keep, xc, 0.0)
        p = tl.where(keep, tl.exp2(xc), 0.0)
        d_blk = tl.sum(p * dist.to(tl.float32), 1)
        l_blk = tl.sum(p, 1)
    else:
        p = tl.exp2(xc)
        l_blk = tl.sum(p, 1)
        d_blk = (rows - start_n).to(tl.float32) * l_blk - tl.sum(p * cols0.to(tl.float32)[None, :], 1)
    a_i = r * (a_i + l_i * shift) + tl.sum(p * xc, 1)
    l_i = r * l_i + l_blk
    d_i = r * d_i + d_blk
    return m_new, l_i, a_i, d_i


@triton.jit
def _attention_stats_kernel(
    Q, K, Out,  # q (B, H, T, D), k (B, Hkv, T, D), any strides; Out (8, B, H, T) fp32 contiguous
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    H, T, GROUPS, PLANE,  # GROUPS = H // Hkv, PLANE = B * H * T (Out[i] holds output OUTPUTS[i])
    scale, softcap, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + (h // GROUPS).to(tl.int64) * stride_kh

    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)  # query positions t
    cols0 = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < T, dims < HEAD_DIM
    q = tl.load(q_base + rows[:, None] * stride_qt + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)

    neg_inf = float("-inf")
    m_i = tl.full([BLOCK_M], neg_inf, tl.float32)  # running max over visible keys s >= 1 (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # sum 2^(x-m)
    a_i = tl.zeros([BLOCK_M], tl.float32)  # sum 2^(x-m) (x-m)
    d_i = tl.zeros([BLOCK_M], tl.float32)  # sum 2^(x-m) (t-s)

    # Key blocks: [lo, hi) is what any query of the block sees (causal, window). Blocks in [full_lo, start_m) are
    # visible to every query of the block and hold no key 0: no masks there. BLOCK_M is a multiple of BLOCK_N.
    hi = tl.minimum(start_m + BLOCK_M, T)
    lo = 0
    full_lo = BLOCK_N
    if HAS_WINDOW:
        lo = tl.maximum(start_m - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.maximum(full_lo, tl.cdiv(start_m + BLOCK_M - window, BLOCK_N) * BLOCK_N)
    mid_lo = tl.minimum(full_lo, start_m)
    for start_n in range(lo, mid_lo, BLOCK_N):  # key 0's block, the window's lower edge
        m_i, l_i, a_i, d_i = _key_block(q, k_base, stride_kt, stride_kd, start_n, rows, cols0, dims, dim_ok,
                                        m_i, l_i, a_i, d_i, T, scale, softcap, window,
                                        True, HAS_SOFTCAP, HAS_WINDOW, IEEE)
    for start_n in range(mid_lo, start_m, BLOCK_N):  # the bulk
        m_i, l_i, a_i, d_i = _key_block(q, k_base, stride_kt, stride_kd, start_n, rows, cols0, dims, dim_ok,
                                        m_i, l_i, a_i, d_i, T, scale, softcap, window,
                                        False, HAS_SOFTCAP, HAS_WINDOW, IEEE)
    for start_n in range(start_m, hi, BLOCK_N):  # the diagonal (lo <= start_m always)
        m_i, l_i, a_i, d_i = _key_block(q, k_base, stride_kt, stride_kd, start_n, rows, cols0, dims, dim_ok,
                                        m_i, l_i, a_i, d_i, T, scale, softcap, window,
                                        True, HAS_SOFTCAP, HAS_WINDOW, IEEE)
    m_i = m_i * LN2  # back to natural-log units
    a_i = a_i * LN2

    # key 0 (sink) and the diagonal key: one dot product each per query
    qf = q.to(tl.float32)
    k0 = tl.load(k_base + dims * stride_kd, mask=dim_ok, other=0.0).to(tl.float32)
    kd = tl.load(k_base + rows[:, None] * stride_kt + dims[None, :] * stride_kd,
                 mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    s0 = tl.sum(qf * k0[None, :], 1) * scale
    sd = tl.sum(qf * kd, 1) * scale
    if HAS_SOFTCAP:
        s0 = _tanh(s0 / softcap) * softcap
        sd = _tanh(sd / softcap) * softcap
    sink_visible = rows >= 0
    if HAS_WINDOW:
        sink_visible = rows < window
    big = tl.where(sink_visible, tl.maximum(m_i, s0), m_i)  # the max over all visible keys (finite: key t is one)
    c = tl.exp(m_i - big)  # non-sink sums re-referenced to `big`; 0 at t = 0
    shift = tl.where(m_i == neg_inf, 0.0, m_i - big)
    e0 = tl.where(sink_visible, tl.exp(s0 - big), 0.0)
    lf = c * l_i + e0
    af = c * (a_i + l_i * shift) + tl.where(sink_visible, e0 * (s0 - big), 0.0)
    bf = c * d_i + e0 * rows.to(tl.float32)
    nan = float("nan")
    ent_nosink = tl.where(rows == 0, nan, tl.log(l_i) - a_i / l_i)
    dist_nosink = tl.where(rows == 0, nan, d_i / l_i)

    plane = PLANE
    o = Out + pid_bh.to(tl.int64) * T + rows
    tl.store(o, tl.log(lf) - af / lf, mask=row_ok)  # entropy
    tl.store(o + plane, bf / lf, mask=row_ok)  # distance
    tl.store(o + 2 * plane, tl.exp(sd - big) / lf, mask=row_ok)  # diag
    tl.store(o + 3 * plane, e0 / lf, mask=row_ok)  # sink
    tl.store(o + 4 * plane, ent_nosink, mask=row_ok)  # entropy_nosink
    tl.store(o + 5 * plane, dist_nosink, mask=row_ok)  # distance_nosink
    tl.store(o + 6 * plane, big + tl.log(lf), mask=row_ok)  # lse
    tl.store(o + 7 * plane, tl.where(rows == 0, nan, m_i + tl.log(l_i)), mask=row_ok)  # lse_nosink


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_blocks(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) without tuning (the interpreter, explicit blocks): flash-forward-like tiles."""
    return (64, 64, 4) if head_dim <= 128 else (64, 32, 8)


def _configs() -> list:
    """Candidate tiles for the autotuner, as Triton's flash-attention forward tunes them (BLOCK_M a multiple of
    BLOCK_N: the loop's diagonal split needs it). Wide heads (D > 128) drop the largest tiles (shared memory)."""
    tiles = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2),
             (64, 64, 8, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]


def _prune(configs, named_args, **kwargs):
    """The autotuner's early pruning: only tiles of at most 64 x 64 for head dims above 128."""
    wide = named_args["HEAD_DIM"] > 128 if "HEAD_DIM" in named_args else kwargs.get("HEAD_DIM", 0) > 128
    return [c for c in configs if not wide or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64] or configs[-1:]


# tuned once per (head dim, length, options) and cached for the process: one teacher pass reuses one length
_tuned_kernel = triton.autotune(configs=_configs(), key=["HEAD_DIM", "T", "HAS_SOFTCAP", "HAS_WINDOW", "IEEE"],
                                prune_configs_by={"early_config_prune": _prune})(_attention_stats_kernel)


def attention_stats_triton(q: torch.Tensor, k: torch.Tensor, scale: float, window: int | None = None,
                           softcap: float | None = None, block_m: int | None = None,
                           block_n: int | None = None) -> dict[str, torch.Tensor]:
    """The Triton twin of `attention_stats`: q (B, H, T, D), k (B, Hkv, T, D) -> dict of (B, H, T) fp32 tensors.
    Tiles are autotuned on a GPU unless `block_m` / `block_n` are given (tests; the interpreter uses fixed ones)."""
    groups = check_inputs(q, k, window, softcap)
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError(f"the Triton attention-statistics kernel runs on a CUDA GPU, but q is on {q.device}; use "
                         "backend 'torch' (or TRITON_INTERPRET=1 for the interpreter, tests only)")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton attention-statistics kernel takes fp32/bf16/fp16 q and k, got {q.dtype}; "
                        "use backend 'torch' for fp64")
    k = k.to(q.dtype)
    B, H, T, D = q.shape
    tune = block_m is None and block_n is None and not _interpreting()
    bm, bn, warps = default_blocks(D)
    bm, bn = block_m or bm, block_n or bn
    if min(bm, bn) < 16 or bm & (bm - 1) or bn & (bn - 1) or bm < bn:
        raise ValueError(f"block sizes must be powers of two >= 16 (tl.dot) with block_m >= block_n, got {bm}, {bn}")
    out = torch.empty(len(OUTPUTS), B, H, T, device=q.device, dtype=torch.float32)
    if T == 0 or B * H == 0:
        return dict(zip(OUTPUTS, out.unbind(0)))
    args = (q, k, out, *q.stride(), *k.stride(), H, T, groups, B * H * T,
            float(scale), float(softcap or 0.0), int(window or 0))
    flags = dict(HEAD_DIM=D, BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_SOFTCAP=bool(softcap),
                 HAS_WINDOW=window is not None, IEEE=q.dtype == torch.float32)
    if tune:
        _tuned_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](*args, **flags)
    else:
        _attention_stats_kernel[(triton.cdiv(T, bm), B * H)](*args, **flags, BLOCK_M=bm, BLOCK_N=bn,
                                                               num_warps=warps, num_stages=2)
    return dict(zip(OUTPUTS, out.unbind(0)))
