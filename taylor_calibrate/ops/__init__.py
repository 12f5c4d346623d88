"""Gated delta rule ops (METHOD.md section 2) and the one place a backend is chosen.

    backend "torch": ops/reference.py, pure PyTorch, any device (the CPU / CI path)
    backend "fla":   ops/fla.py, flash-linear-attention's Triton kernels, CUDA only
    backend "auto":  "fla" when fla imports and a GPU is visible, else "torch"; resolved once per
                     process and logged, never a silent fallback for an explicit "fla".
"""

from __future__ import annotations

import logging

import torch

from . import fla as fla_ops
from . import reference
from .reference import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule

__all__ = [
    "BACKENDS", "MODES", "resolve_backend", "gated_delta_rule",
    "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "l2norm",
]

logger = logging.getLogger("taylor_calibrate")

BACKENDS = ("auto", "torch", "fla")
MODES = ("auto", "chunk", "recurrent")
DECODE_MAX_T = 16  # mode "auto" runs the recurrent form up to this many tokens (decoding)

_resolved: dict[str, str] = {}


def resolve_backend(name: str) -> str:
    """Map a backend choice to "torch" or "fla" (cached per name, logged once); fail loudly on "fla"."""
    if name in _resolved:
        return _resolved[name]
    if name not in BACKENDS:
        raise ValueError(f"unknown GDN backend {name!r}; choose one of {', '.join(BACKENDS)}")
    reason = None if name == "torch" else fla_ops.fla_unavailable_reason()
    if name == "fla" and reason is not None:
        raise RuntimeError(
            f"GDN backend 'fla' was requested but is unavailable ({reason}). It needs flash-linear-attention "
            f"(`{fla_ops.INSTALL_HINT}`) and a CUDA GPU; or use `--backend torch`."
        )
    resolved = "torch" if name == "torch" or reason is not None else "fla"
    logger.info("GDN backend: %s -> %s%s", name, resolved, f" ({reason})" if reason else "")
    _resolved[name] = resolved
    return resolved


_IMPLS = {
    ("torch", "chunk"): reference.chunk_gated_delta_rule,
    ("torch", "recurrent"): reference.recurrent_gated_delta_rule,
    ("fla", "chunk"): fla_ops.chunk_gated_delta_rule,
    ("fla", "recurrent"): fla_ops.recurrent_gated_delta_rule,
}


def gated_delta_rule(
    q: torch.Tensor,  # (B, T, H, K), L2-normalised unless use_qk_l2norm
    k: torch.Tensor,  # (B, T, H, K), L2-normalised unless use_qk_l2norm
    v: torch.Tensor,  # (B, T, H, V)
    g: torch.Tensor,  # (B, T, H) log decay, <= 0
    beta: torch.Tensor,  # (B, T, H) write strength in (0, 1)
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,  # (B, H, K, V) fp32
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    backend: str = "torch",
    mode: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the gated delta rule; returns (o: (B, T, H, V), final state (B, H, K, V) or None).

    mode "auto" takes the recurrent form for T <= 16 (decoding) and the chunked form otherwise,
    except that with backend "fla" it takes the chunked form whenever autograd will need
    gradients, because fla's fused recurrent kernel has no backward.
    """
    backend = resolve_backend(backend)
    if mode not in MODES:
        raise ValueError(f"unknown GDN mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "auto":
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)
        )
        short = q.shape[1] <= DECODE_MAX_T
        mode = "recurrent" if short and not (backend == "fla" and needs_grad) else "chunk"
    return _IMPLS[backend, mode](
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
    )
