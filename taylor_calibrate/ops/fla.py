"""flash-linear-attention's fused Triton kernels for the gated delta rule (docs/method.md,
"The GDN layer").

The only module of the package that imports fla, and only inside functions, so importing it never
fails on a machine without fla or without a GPU. The wrappers take exactly the arguments of the
references in ops/reference.py and return the same things; tests/test_ops.py holds them to it.

fla 0.6.0 facts this module relies on (read off its source):
  * `chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, ..., cu_seqlens, **kwargs)`; `chunk_size` (16, 32 or 64) goes through
    **kwargs; `head_first` is gone (raises): inputs are (B, T, H, D). It returns o in q.dtype.
  * `fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, ...)`: `gk` and
    `gv` sit between g and beta, so everything after v must be passed by keyword. It returns o in
    v.dtype and has NO backward (raises NotImplementedError), so it is for decoding only.
  * State (N, H, K, V), K-first unless `state_v_first=True`; final state is always fp32.
  * g is log-space decay, kept fp32 (as fla's GatedDeltaNet layer passes it); q, k, v bf16/fp16/fp32.
  * On Hopper with 3.4 <= Triton < 3.7.1 the chunked backward raises rather than return wrong
    gradients (fla issue #640) unless tilelang is installed: `check_fla_backward` turns that into an actionable
    message (the early check for `--backend fla`), `first_backward` finds it out on the first real training step
    (backend auto: no separate check that compiles kernels for shapes no layer has).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
from pathlib import Path

import torch

logger = logging.getLogger("taylor_calibrate")

INSTALL_HINT = "pip install flash-linear-attention fla-core"
FIX_BACKWARD = (
    "Fix: install tilelang (`pip install tilelang`) or upgrade Triton to >=3.7.1 "
    "(`pip install -U 'triton>=3.7.1'`), or use `--backend torch`."
)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


TUNED_CONFIGS = Path(__file__).parent / "fla_configs"  # fla-<version>/<GPU>/<kernel>.json, from benchmarks/fla_configs.py


def use_tuned_configs() -> Path | None:
    """Point fla's autotuner at the kernel configs shipped for this fla version and GPU, if there are any, so a
    fresh machine compiles one config per kernel instead of autotuning every candidate (exact shape match only,
    FLA_CACHE_MODE=strict: any other shape still autotunes). Must run before fla is first imported (fla reads
    the variables at import); a user's own FLA_CACHE_MODE / FLA_CONFIG_DIR win."""
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ or "fla.ops.utils.cache" in sys.modules:
        return None
    try:
        version = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    gpu = re.sub(r"[^0-9A-Za-z]+", "_", torch.cuda.get_device_name(0)).strip("_")  # fla's own GPU key
    folder = TUNED_CONFIGS / f"fla-{version}" / gpu
    if not any(folder.glob("*.json")):
        return None
    os.environ["FLA_CONFIG_DIR"], os.environ["FLA_CACHE_MODE"] = str(folder), "strict"
    logger.info("fla kernel configs tuned for %s (fla %s) read from %s", gpu, version, folder)
    return folder


@functools.cache
def fla_unavailable_reason() -> str | None:
    """None when the fla kernels can run here, else a short reason ("fla not installed / no CUDA")."""
    reasons = []
    if importlib.util.find_spec("fla") is None:
        reasons.append("fla not installed")
    if not torch.cuda.is_available():
        reasons.append("no CUDA")
    if not reasons:
        try:
            use_tuned_configs()
            import fla.ops.gated_delta_rule  # noqa: F401
        except Exception as e:  # a broken Triton install fails here, not at find_spec
            reasons.append(f"import fla.ops.gated_delta_rule failed: {type(e).__name__}: {e}")
    return " / ".join(reasons) or None


def fla_available() -> bool:
    """fla is importable and a CUDA GPU is visible."""
    return fla_unavailable_reason() is None


def _prepare(q, k, v, g, beta, initial_state):
    """Check device and dtype, then cast to what fla's kernels were tested with."""
    if q.device.type != "cuda":
        raise ValueError(
            f"GDN backend 'fla' runs Triton kernels on a CUDA GPU, but the inputs are on {q.device}. "
            "Move the model to the GPU or use `--backend torch`."
        )
    if q.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"fla's kernels take bf16/fp16/fp32 inputs, got {q.dtype}; use `--backend torch` for fp64.")
    k, v, beta = k.to(q.dtype), v.to(q.dtype), beta.to(q.dtype)
    g = g.float()  # log decay: accumulated by a cumsum inside the kernel, keep it fp32
    if initial_state is not None:
        initial_state = initial_state.float()  # the kernels keep the state in fp32
    return q, k, v, g, beta, initial_state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's chunked kernel (forward and backward): the training / prefill path on a GPU."""
    out_dtype = v.dtype
    q, k, v, g, beta, initial_state = _prepare(q, k, v, g, beta, initial_state)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    o, final_state = fla_chunk(
        q, k, v, g, beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        chunk_size=chunk_size,
    )
    return o.to(out_dtype), final_state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's fused recurrent kernel: forward only (no backward in fla), for token-by-token decoding."""
    out_dtype = v.dtype
    q, k, v, g, beta, initial_state = _prepare(q, k, v, g, beta, initial_state)
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    o, final_state = fla_recurrent(
        q, k, v,
        g=g,  # by keyword: fla's signature has gk, gv between g and beta
        beta=beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return o.to(out_dtype), final_state


@functools.cache
def check_fla_backward() -> str | None:
    """Run a tiny forward + backward through fla's chunk kernel once per process; None if it works, else why not.

    fla refuses the chunked backward on some GPU / Triton combinations (Hopper with
    3.4 <= Triton < 3.7.1); finding that out before a training run starts beats a crash at step 1.
    """
    reason = fla_unavailable_reason()
    if reason is not None:
        return (
            f"GDN backend 'fla' is unavailable ({reason}): `{INSTALL_HINT}` on a CUDA machine, "
            "or use `--backend torch`."
        )
    try:
        B, T, H, K, V = 1, 80, 2, 64, 64  # two chunks, the second one partial
        gen = torch.Generator(device="cuda").manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, device="cuda", generator=gen)

        q, k = (torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).bfloat16() for _ in range(2))
        v = randn(B, T, H, V).bfloat16()
        g = torch.nn.functional.logsigmoid(randn(B, T, H))
        beta = randn(B, T, H).sigmoid().bfloat16()
        h0 = randn(B, H, K, V)
        for x in (q, k, v, g, beta, h0):
            x.requires_grad_(True)
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        (o.float().sum() + ht.sum()).backward()
        torch.cuda.synchronize()
    except Exception as e:
        import triton

        return (
            f"fla's chunked gated-delta-rule backward does not run here "
            f"({torch.cuda.get_device_name()}, Triton {triton.__version__}): {type(e).__name__}: {e}\n{FIX_BACKWARD}"
        )
    return None


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"


class _FirstBackward(torch.autograd.Function):
    """fla's chunk kernel where no backward through it has run yet in this process (see `first_backward`)."""

    @staticmethod
    def forward(ctx, reference, state, kw, q, k, v, g, beta, h0):
        ctx.reference, ctx.state, ctx.kw = reference, state, kw
        ctx.save_for_backward(q, k, v, g, beta, h0)
        with torch.no_grad():
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, **kw)

    @staticmethod
    def backward(ctx, do, dht):
        inputs = [None if x is None else x.detach().requires_grad_(need)
                  for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[3:])]

        def grads(kernel):
            with torch.enable_grad():
                o, ht = kernel(*inputs[:5], initial_state=inputs[5], **ctx.kw)
            outs, grad_outs = [o], [do]
            if ht is not None and dht is not None:
                outs.append(ht)
                grad_outs.append(dht)
            wrt = [x for x in inputs if x is not None and x.requires_grad]
            got = iter(torch.autograd.grad(outs, wrt, grad_outs, allow_unused=True))
            return [next(got) if x is not None and x.requires_grad else None for x in inputs]

        if ctx.state.get("problem") is None:
            try:
                result = grads(chunk_gated_delta_rule)
                ctx.state["problem"] = None
                return (None, None, None, *result)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # fla refuses (#640) or its kernels fail to build here
                import triton

                ctx.state["problem"] = (f"fla's chunked gated-delta-rule backward does not run here "
                                        f"({_device_name()}, Triton {triton.__version__}): "
                                        f"{type(e).__name__}: {e}")
                logger.warning("%s; training continues on the torch path (slower). %s", ctx.state["problem"],
                               FIX_BACKWARD)
        return (None, None, None, *grads(ctx.reference))


def first_backward(reference, state: dict, q, k, v, g, beta, initial_state=None, **kw):
    """fla's chunk kernel for a call that needs gradients before any backward through fla has run in this process:
    the forward is fla's; the backward runs the forward again through fla with a graph and differentiates it, and
    where fla's backward refuses to run on this GPU / Triton (fla issue #640) or fails to build, differentiates
    `reference` (the torch kernel, same signature) instead. `state["problem"]` records the outcome (None: fla's
    backward ran), so that later calls go straight to one path. Costs one extra forward, on the first step only, and
    compiles only the kernels of shapes the model has (unlike a separate check)."""
    return _FirstBackward.apply(reference, state, kw, q, k, v, g, beta, initial_state)
