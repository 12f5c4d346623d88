"""Gated delta rule ops (docs/method.md, "The GDN layer") and the one place a backend is chosen.

    backend "torch": ops/reference.py, pure PyTorch, any device (the CPU / CI path)
    backend "fla":   ops/fla.py, flash-linear-attention's Triton kernels, CUDA only
    backend "auto":  "fla" when fla imports and a GPU is visible, else "torch"; resolved once per
                     process and logged, never a silent fallback for an explicit "fla".

Teacher attention statistics (docs/method.md, "Teacher statistics") and the distillation loss over a chunk of
logits each have their own pair, chosen the same way:

    backend "torch":  ops/attention_stats_torch.py (streamed over key blocks) / ops/kd_torch.py, PyTorch, any device
    backend "triton": ops/attention_stats_triton.py / ops/kd_triton.py, fused Triton kernels, CUDA tensors only
    backend "auto":   "triton" for CUDA tensors when triton imports, else "torch"; resolved once per device
                      type and logged
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from . import attention_stats_torch as stats_torch
from . import fla as fla_ops
from . import kd_torch
from . import reference
from .reference import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule

__all__ = [
    "BACKENDS", "MODES", "resolve_backend", "gated_delta_rule",
    "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "l2norm",
    "STATS_BACKENDS", "resolve_stats_backend", "attention_stats",
    "LOSS_BACKENDS", "resolve_loss_backend", "loss_kernel",
]

logger = logging.getLogger("taylor_calibrate")

BACKENDS = ("auto", "torch", "fla")
MODES = ("auto", "chunk", "recurrent")
DECODE_MAX_T = 16  # mode "auto" runs the recurrent form up to this many tokens (decoding)

_resolved: dict[str, str] = {}
_FLA_BACKWARD: dict[str, str | None] = {}  # "problem": None once fla's backward has run in this process, else why not
_fla_backward_refused = False  # set once a training call finds _FLA_BACKWARD["problem"]; read by compiled code


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


GDN_KERNELS = {  # (backend, mode) -> kernel; "torch" is the reference
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
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)
    )
    if mode == "auto":
        short = q.shape[1] <= DECODE_MAX_T
        mode = "recurrent" if short and not (backend == "fla" and needs_grad) else "chunk"
    if backend == "fla" and mode == "chunk" and needs_grad:
        if not _fla_backward_refused:
            return _fla_chunk_for_training(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                           output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)
        backend = "torch"  # fla's backward refused here (logged once): the reference trains, compiled where asked
    return GDN_KERNELS[backend, mode](
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm=use_qk_l2norm,
    )


@torch.compiler.disable
def _fla_chunk_for_training(q, k, v, g, beta, **kw):
    """fla's chunk kernel for a call that needs gradients. The first such call in a process finds out whether fla's
    backward runs here (`fla_ops.first_backward`); later ones call fla's kernel, or, once it refused, the reference
    (and flag it, so that the next call takes the reference in the caller's graph). Kept out of torch.compile: what
    it reads changes after the first step, and a compiled layer that read it would recompile at step 2 (fla's
    kernel is itself outside compiled graphs, so this adds no graph break)."""
    global _fla_backward_refused
    if "problem" not in _FLA_BACKWARD:
        return fla_ops.first_backward(reference.chunk_gated_delta_rule, _FLA_BACKWARD, q, k, v, g, beta, **kw)
    if _FLA_BACKWARD["problem"] is not None:
        _fla_backward_refused = True
        return reference.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    return GDN_KERNELS["fla", "chunk"](q, k, v, g, beta, **kw)


# --- Triton kernels of our own: attention statistics and the distillation loss ---------------------------------------
STATS_BACKENDS = LOSS_BACKENDS = ("auto", "torch", "triton")
_TRITON_MODULES = {"attention-statistics": "attention_stats_triton", "distillation-loss": "kd_triton"}
_stats_resolved: dict[tuple[str, str], str] = {}
_loss_resolved: dict[tuple[str, str], str] = {}


def _triton_import_reason(what: str) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton not installed"
    try:
        importlib.import_module(f"{__name__}.{_TRITON_MODULES[what]}")
    except Exception as e:  # a broken Triton install fails here, not at find_spec
        return f"import triton failed: {type(e).__name__}: {e}"
    return None


def _resolve_triton(what: str, cache: dict, name: str, device: torch.device | str) -> str:
    """Map a choice among ("auto", "torch", "triton") for the op `what` to "torch" or "triton" for tensors on
    `device` (cached in `cache`, logged once). "auto" takes the kernel for CUDA tensors only. An explicit "triton" on
    CPU tensors is allowed only under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported): that is
    how the tests run the kernel without a GPU."""
    device = torch.device(device)
    key = (name, device.type)
    if key in cache:
        return cache[key]
    if name not in STATS_BACKENDS:
        raise ValueError(f"unknown {what} backend {name!r}; choose one of {', '.join(STATS_BACKENDS)}")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if name == "torch":
        reason = None
    elif device.type != "cuda" and (name == "auto" or not interpreting):
        reason = f"tensors on {device.type}"
    else:
        reason = _triton_import_reason(what)
    if name == "triton" and reason is not None:
        raise RuntimeError(f"{what} backend 'triton' was requested but is unavailable ({reason}); it needs CUDA "
                           "tensors and `pip install triton` (bundled with CUDA builds of torch), or use backend "
                           "'torch'.")
    resolved = "torch" if name == "torch" or reason is not None else "triton"
    logger.info("%s backend (%s tensors): %s -> %s%s", what, device.type, name, resolved,
                f" ({reason})" if reason else "")
    cache[key] = resolved
    return resolved


def resolve_stats_backend(name: str, device: torch.device | str) -> str:
    """The attention-statistics kernel for tensors on `device`: "torch" or "triton" (see `_resolve_triton`)."""
    return _resolve_triton("attention-statistics", _stats_resolved, name, device)


def resolve_loss_backend(name: str, device: torch.device | str) -> str:
    """The distillation loss's kernel over a chunk of logits for tensors on `device`: "torch" or "triton"."""
    return _resolve_triton("distillation-loss", _loss_resolved, name, device)


def loss_kernel(backend: str, device: torch.device | str, compiled: bool):
    """The function that reduces one chunk of logits to the distillation loss and its gradient (`kd_chunk`'s
    signature): ops/kd_triton.py's kernel, or ops/kd_torch.py's reference (compiled when `compiled`)."""
    if resolve_loss_backend(backend, device) == "triton":
        from .kd_triton import kd_chunk_triton
        return kd_chunk_triton
    return torch.compile(kd_torch.kd_chunk) if compiled else kd_torch.kd_chunk


def attention_stats(q: torch.Tensor, k: torch.Tensor, scale: float, window: int | None = None,
                    softcap: float | None = None, block: int = 256, *, backend: str = "auto") -> dict[str, torch.Tensor]:
    """Per-query attention statistics (see ops/attention_stats_torch.py): q (B, H, T, D), k (B, Hkv, T, D) with Hkv
    dividing H (GQA) -> dict of (B, H, T) fp32 tensors. `block` is the torch path's key block.

    With backend "auto", fp64 inputs take the torch path, and a kernel that fails to compile or launch on this GPU is reported once (warning, with the
    error) and the torch path takes over for the rest of the process; an explicit "triton" raises instead.
    """
    resolved = resolve_stats_backend(backend, q.device)
    if resolved == "triton" and (backend == "triton" or q.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        from .attention_stats_triton import attention_stats_triton

        try:
            return attention_stats_triton(q, k, scale, window, softcap)
        except (torch.OutOfMemoryError, ValueError, TypeError):
            raise  # bad input or a full GPU: the torch path would not do better
        except Exception as e:
            if backend != "auto":
                raise
            logger.warning("the Triton attention-statistics kernel failed here (%s: %s); backend auto -> torch for "
                           "the rest of this process", type(e).__name__, e)
            _stats_resolved["auto", q.device.type] = "torch"
    return stats_torch.attention_stats(q, k, scale, window, softcap, block)


def training_backend(backend: str, asked: str, needed: bool) -> str:
    """The backend a stage trains with: fla's backward refuses to run on some GPU/Triton pairs (Hopper with
    Triton < 3.7.1 and no tilelang). Asked for fla by name: check now (before any model loads) and fail with the
    fix. auto: no separate check (it would compile kernels for shapes no layer has); the first training step finds
    out (`gated_delta_rule`), and if fla's backward refuses, says so and trains on the torch path."""
    if not needed or backend != "fla":
        return backend
    if asked != "fla":
        logger.info("GDN training backend: fla, its backward checked on the first training step (torch if it "
                    "does not run here)")
        return backend
    problem = fla_ops.check_fla_backward()
    if problem is not None:
        raise RuntimeError(f"the GDN layers train through fla's kernels, whose backward does not run here: {problem}")
    _FLA_BACKWARD["problem"] = None
    return backend
