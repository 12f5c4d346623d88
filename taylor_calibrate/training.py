"""What the two training stages (phase 2 alignment, recovery distillation) share: the learning-rate schedules, the row
order, the mixed-precision rule, the attention kernel for training rows and a training clock."""
from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import Tensor

from taylor_calibrate.config import ATTENTIONS
from taylor_calibrate.memory import SLIDING_TYPES
from taylor_calibrate.model.hybrid_config import cached_layer_types


def wsd(step: int, steps: int, decay_fraction: float) -> float:
    """Warmup-free "warmup-stable-decay": 1 until the last `decay_fraction` of the `steps`, then straight down to
    1 / steps at the last one (1-based `step`; the last step still moves)."""
    n = max(1, steps)
    progress = step / n  # (0, 1]
    return min(1.0, (1.0 - progress) / decay_fraction + 1.0 / n)


def warmup_cosine(step: int, steps: int, warmup_steps: int) -> float:
    """Linear warmup over `warmup_steps`, then a cosine from 1 to 0.1 at the last step (1-based `step`)."""
    if step <= warmup_steps:
        return step / warmup_steps
    n = max(1, steps - warmup_steps)
    progress = (step - warmup_steps) / n  # (0, 1]
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def batch_indices(num_rows: int, batch_size: int, steps: int, seed: int) -> Tensor:
    """(steps, batch_size) row indices: seeded permutations of range(num_rows), one per epoch, concatenated."""
    g = torch.Generator().manual_seed(seed)
    need = steps * batch_size
    perms = [torch.randperm(num_rows, generator=g) for _ in range(-(-need // num_rows))]
    return torch.cat(perms)[:need].view(steps, batch_size) if perms else torch.zeros(0, batch_size, dtype=torch.long)


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 master weights of what trains, `hold_frozen` for the rest), nothing on CPU: the one
    mixed-precision rule of training."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def hold_frozen(model: torch.nn.Module, device: torch.device) -> list[torch.nn.Parameter]:
    """On CUDA, the parameters that do not train are held in autocast's bf16 for the run (`release_frozen` puts fp32
    back): autocast casts them to bf16 for every matmul anyway, and with a bf16 embedding the residual stream, its
    norms, adds and their gradients run in bf16, as the teacher's own do, instead of fp32 (half the memory traffic
    and the stored activations). Trained parameters keep their fp32 master weights. A hybrid converted on a GPU holds
    bf16 values already (exact); others are rounded to bf16 as the teacher's copy on the GPU is. Returns the
    parameters it changed; nothing on CPU (training there runs in fp32)."""
    if device.type != "cuda":
        return []
    held = [p for p in model.parameters() if not p.requires_grad and p.dtype == torch.float32]
    for p in held:
        p.data = p.data.to(torch.bfloat16)
    return held


def release_frozen(held: list[torch.nn.Parameter]) -> None:
    """Undo `hold_frozen`: its parameters are fp32 again (with the bf16 values they trained beside)."""
    for p in held:
        p.data = p.data.float()


def windowed(config, seq_len: int) -> bool:
    """Whether some attention layer of `config` (teacher or hybrid) has a sliding window shorter than `seq_len`."""
    window = getattr(config, "sliding_window", None)
    return bool(window) and window < seq_len and any(t in SLIDING_TYPES for t in cached_layer_types(config))


def resolve_attention(choice: str, config, seq_len: int, device: torch.device) -> str:
    """The attention implementation for training on rows of `seq_len` tokens. "auto": flex_attention on CUDA when a
    sliding window is shorter than the row (sdpa then gets a dense T x T mask and computes every block of it, where
    flex_attention's block mask skips the blocks outside the window), else sdpa (causal rows go to its flash kernels)."""
    if choice not in ATTENTIONS:
        raise ValueError(f"--train.attention={choice!r} is not one of {ATTENTIONS}")
    if choice == "auto":
        return "flex_attention" if device.type == "cuda" and windowed(config, seq_len) else "sdpa"
    if choice == "flex_attention" and device.type != "cuda":
        raise ValueError(f"--train.attention flex_attention trains on CUDA only (torch has no flex_attention backward "
                         f"on {device.type}); use --train.attention sdpa or auto here")
    return choice


def swap_attention(models, impl: str) -> list:
    """Run `models` with transformers' attention implementation `impl`; returns what `restore_attention` needs."""
    before = [(m, m.config._attn_implementation) for m in models]
    for m, old in before:
        if old != impl:
            m.set_attn_implementation(impl)
    return before


def restore_attention(before: list) -> None:
    """Undo `swap_attention`: each model's own implementation again."""
    for m, old in before:
        if m.config._attn_implementation != old:
            m.set_attn_implementation(old)


class Clock:
    """Training wall time without a host sync per step: synchronises only when it starts, pauses (evaluation,
    checkpoints) or is read (log steps)."""

    def __init__(self, device):
        self.device, self.t0, self.excluded = device, None, 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self) -> None:
        self.t0 = self._now()

    @contextlib.contextmanager
    def paused(self):
        t = self._now()
        yield
        self.excluded += self._now() - t

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else self._now() - self.t0 - self.excluded

    def rate(self, tokens: int) -> float | None:
        if self.t0 is None or tokens <= 0:
            return None
        return tokens / self.elapsed()
