"""The distillation loss over one chunk of logits, in PyTorch: the reference of ops/kd_triton.py (the same signature;
tests/test_kd_kernel.py holds the two together) and the CPU path. `distill.fused_kd` and `distill.chunked_kl` call
it chunk by chunk; under --train.compile it runs compiled (docs/method.md, "End-to-end phase")."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kd_chunk(s, t, y, w, tau: float, kl_scale: float, ce_scale: float, s_cap: float | None = None,
             t_cap: float | None = None, grad: bool = True):
    """One chunk of n rows, fp32 inside: (sum over rows of w x KL(p_t || p_s) at temperature tau, sum of the
    next-token NLL, the gradient of kl_scale x that KL sum + ce_scale x that NLL sum w.r.t. `s` in s's dtype; None
    for what was not asked).

    s, t: (n, V) logits of student and teacher before their soft-caps `s_cap`, `t_cap` (cap x tanh(logit / cap),
    Gemma's final_logit_softcapping); t None: no KL. y (n,): next-token ids, negative where there is none; None: no
    NLL. w (n,): the rows' KL weights (None: 1). dKL/ds = (p_s - p_t) / tau, dNLL/ds = softmax(s) - onehot(y), times
    1 - (s / cap)^2 through a cap. The one kernel of both loss paths; `--train.compile` compiles it."""
    dtype = s.dtype
    s = s.float()
    if s_cap:
        s = torch.tanh(s / s_cap) * s_cap
    kl = nll = g = s_logp = None
    if t is not None:
        t = t.float()
        if t_cap:
            t = torch.tanh(t / t_cap) * t_cap
        s_logp, t_logp = F.log_softmax(s / tau, -1), F.log_softmax(t / tau, -1)
        t_p = t_logp.exp()
        kl = (t_p * (t_logp - s_logp)).sum(-1)
        if grad:
            g = (s_logp.exp() - t_p) * (kl_scale / tau)
        if w is not None:
            kl = kl * w
            g = None if g is None else g * w[:, None]
        kl = kl.sum()
    if y is not None:
        logp = s_logp if s_logp is not None and tau == 1.0 else F.log_softmax(s, -1)
        valid = (y >= 0).float()
        at = y.clamp(min=0)[:, None]
        nll = -(logp.gather(1, at).squeeze(1) * valid).sum()
        if grad:
            gc = logp.exp().scatter_add(1, at, torch.full_like(at, -1, dtype=logp.dtype)) * (valid * ce_scale)[:, None]
            g = gc if g is None else g + gc
    if g is not None and s_cap:
        g = g * (1 - (s / s_cap) ** 2)
    return kl, nll, None if g is None else g.to(dtype)
