"""What the two training stages (phase 2 alignment, recovery distillation) share: the learning-rate schedules, the row
order, the mixed-precision rule and a training clock."""
from __future__ import annotations

import contextlib
import math
import time

import torch
from torch import Tensor


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
    """bf16 autocast on CUDA (fp32 master weights), nothing on CPU: the one mixed-precision rule of training."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


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
