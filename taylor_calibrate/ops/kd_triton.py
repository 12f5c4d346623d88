"""The distillation loss over one chunk of logits as one Triton program per row: `kd_chunk` of ops/kd_torch.py (its
reference, same signature and outputs; tests/test_kd_kernel.py holds the two together) in two passes over the
vocabulary instead of the several a compiled `kd_chunk` makes.

Pass 1 reads the row's student and teacher logits once, with online-softmax accumulators, all fp32:

    a = cap(s) / tau, b = cap(t) / tau
    m_a, l_a = running max and sum e^(a - m_a)         (likewise m_b, l_b)
    c = sum e^(b - m_b) (b - a)                         (rescaled as m_b moves)
    KL(p_b || p_a) = c / l_b - lse_b + lse_a,   lse = m + log l

and, for the next-token NLL at tau != 1, the same max and sum of cap(s) itself. Pass 2 (when the gradient is asked)
reads both rows again and writes kl_scale / tau x w x (p_a - p_b) + ce_scale x valid x (softmax(cap(s)) - onehot(y)),
times 1 - (cap(s) / cap)^2 under a cap, in the logits' dtype. So a chunk costs two reads of each logit and one write
of its gradient: memory-bound, as the loss is.

Importing this module needs triton; the dispatcher (ops/__init__.py) imports it only when it picks this backend. On a
CPU the kernel runs under Triton's interpreter only (TRITON_INTERPRET=1 before import): that is for the tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _capped(x, cap):
    """cap x tanh(x / cap), tanh written with a sigmoid (exact, and in every Triton build)."""
    return cap * (2.0 * tl.sigmoid(2.0 * x / cap) - 1.0)


@triton.jit
def _kd_rows(S, T, Y, W, CE, KL, NLL, G, V, stride_s, stride_t, stride_g, inv_tau, kl_scale, s_cap, t_cap,
             HAS_T: tl.constexpr, HAS_Y: tl.constexpr, HAS_W: tl.constexpr, S_CAP: tl.constexpr,
             T_CAP: tl.constexpr, SEP: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_row, t_row = S + row * stride_s, T + row * stride_t
    cols = tl.arange(0, BLOCK)
    neg = float("-inf")
    zero = tl.zeros([], dtype=tl.float32)
    m_a, l_a = zero + neg, zero
    m_b, l_b, c = zero + neg, zero, zero
    m_s, l_s = zero + neg, zero  # cap(s) itself, for the NLL when tau != 1 (SEP)
    for off in range(0, V, BLOCK):  # pass 1: the row's softmax statistics and KL
        mask = off + cols < V
        s = tl.load(s_row + off + cols, mask=mask, other=0.0).to(tl.float32)
        if S_CAP:
            s = _capped(s, s_cap)
        a = tl.where(mask, s * inv_tau, neg)
        m_new = tl.maximum(m_a, tl.max(a, 0))
        l_a = l_a * tl.exp(m_a - m_new) + tl.sum(tl.exp(a - m_new), 0)
        m_a = m_new
        if SEP:
            sm = tl.where(mask, s, neg)
            m_new = tl.maximum(m_s, tl.max(sm, 0))
            l_s = l_s * tl.exp(m_s - m_new) + tl.sum(tl.exp(sm - m_new), 0)
            m_s = m_new
        if HAS_T:
            t = tl.load(t_row + off + cols, mask=mask, other=0.0).to(tl.float32)
            if T_CAP:
                t = _capped(t, t_cap)
            b = tl.where(mask, t * inv_tau, neg)
            m_new = tl.maximum(m_b, tl.max(b, 0))
            e = tl.exp(b - m_new)
            scale = tl.exp(m_b - m_new)
            l_b = l_b * scale + tl.sum(e, 0)
            c = c * scale + tl.sum(tl.where(mask, e * (b - a), 0.0), 0)
            m_b = m_new
    lse_a = m_a + tl.log(l_a)
    w = 1.0
    if HAS_W:
        w = tl.load(W + row).to(tl.float32)
    if HAS_T:
        lse_b = m_b + tl.log(l_b)
        tl.store(KL + row, (c / l_b - lse_b + lse_a) * w)
    lse_s = lse_a
    if SEP:
        lse_s = m_s + tl.log(l_s)
    y = -1
    if HAS_Y:
        y = tl.load(Y + row)
        valid = y >= 0
        s_y = tl.load(s_row + tl.maximum(y, 0)).to(tl.float32)
        if S_CAP:
            s_y = _capped(s_y, s_cap)
        tl.store(NLL + row, tl.where(valid, lse_s - s_y, 0.0))
    if GRAD:
        g_row = G + row * stride_g
        ce = 0.0
        if HAS_Y:
            ce = tl.where(y >= 0, tl.load(CE).to(tl.float32), 0.0)
        for off in range(0, V, BLOCK):  # pass 2: the gradient w.r.t. the student's logits
            mask = off + cols < V
            s = tl.load(s_row + off + cols, mask=mask, other=0.0).to(tl.float32)
            if S_CAP:
                s = _capped(s, s_cap)
            g = tl.zeros([BLOCK], dtype=tl.float32)
            if HAS_T:
                t = tl.load(t_row + off + cols, mask=mask, other=0.0).to(tl.float32)
                if T_CAP:
                    t = _capped(t, t_cap)
                g = (tl.exp(s * inv_tau - lse_a) - tl.exp(t * inv_tau - lse_b)) * (kl_scale * inv_tau * w)
            if HAS_Y:
                p = tl.exp(s - lse_s)
                g += (p - tl.where(off + cols == y, 1.0, 0.0)) * ce
            if S_CAP:
                r = s / s_cap
                g = g * (1.0 - r * r)
            tl.store(g_row + off + cols, g.to(G.dtype.element_ty), mask=mask)


def kd_chunk_triton(s, t, y, w, tau: float, kl_scale: float, ce_scale, s_cap: float | None = None,
                    t_cap: float | None = None, grad: bool = True):
    """`kd_chunk` (ops/kd_torch.py) as one Triton program per row: same arguments, same (kl sum, nll sum, gradient)."""
    if s.dim() != 2 or s.stride(-1) != 1 or (t is not None and (t.shape != s.shape or t.stride(-1) != 1)):
        raise ValueError(f"kd_chunk_triton takes (n, V) logits with contiguous rows; got student {tuple(s.shape)} "
                         f"{s.stride()}, teacher {None if t is None else (tuple(t.shape), t.stride())}")
    n, V = s.shape
    dev = s.device
    kl = torch.empty(n, dtype=torch.float32, device=dev) if t is not None else None
    nll = torch.empty(n, dtype=torch.float32, device=dev) if y is not None else None
    want = grad and (t is not None or y is not None)
    g = torch.empty_like(s) if want else None
    dummy = s  # pointer arguments a flag leaves unread
    ce = dummy  # read only with labels; a float becomes a device tensor by a fill, not a host-to-device copy (a sync)
    if y is not None:
        ce = (ce_scale.to(device=dev, dtype=torch.float32).reshape(1) if torch.is_tensor(ce_scale)
              else torch.full((1,), float(ce_scale), dtype=torch.float32, device=dev))
    block = min(triton.next_power_of_2(V), 4096)
    _kd_rows[(n,)](s, t if t is not None else dummy, y if y is not None else dummy,
                   w.float().contiguous() if w is not None else dummy, ce, kl if kl is not None else dummy,
                   nll if nll is not None else dummy, g if g is not None else dummy, V, s.stride(0),
                   t.stride(0) if t is not None else 0, g.stride(0) if g is not None else 0, 1.0 / tau, float(kl_scale),
                   float(s_cap or 1.0), float(t_cap or 1.0), HAS_T=t is not None, HAS_Y=y is not None,
                   HAS_W=w is not None, S_CAP=bool(s_cap), T_CAP=bool(t_cap) and t is not None,
                   SEP=y is not None and tau != 1.0, GRAD=want, BLOCK=block, num_warps=8)
    return (None if kl is None else kl.sum(), None if nll is None else nll.sum(), g)
