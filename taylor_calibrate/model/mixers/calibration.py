"""Targets phase 1 derives from the teacher's attention statistics, shared by the mixers' calibrators: decay
distance d_h, concentration c_h, the local attention band, and the small solvers that set a gate's level
(docs/method.md, "Phase 1: calibration"). Torch only: imports nothing of ours; `st` is a layer's statistics
(stats.LayerStats), `args` the phase-1 options (config.CalibArgs)."""
from __future__ import annotations

import torch


def inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def concentration(st, paper: bool = False) -> torch.Tensor:
    """c_h in [0, 1]: 1 = one-hot attention, 0 = uniform. taylor: 1 - H_t / log n_t with the sink's mass dropped (it
    does not depend on the layer's other heads); paper: min-max over the layer's heads with the sink counted, as the
    reference."""
    if not paper:
        return st.concentration_abs_nosink.clamp(0, 1)
    H = st.entropy
    return 1 - (H - H.min()) / (H.max() - H.min()).clamp_min(1e-3)


def distance(st, paper: bool = False) -> torch.Tensor:
    """d_h, the mean attention distance: taylor drops the sink's mass; paper counts it and floors each query's
    distance at 0.5, as the reference."""
    return (st.distance_floored if paper else st.distance_nosink).clamp_min(0.5)


def local_band(st) -> torch.Tensor:
    """(H, BAND) mean attention p_{t,t-j} on the nearest offsets j, the sink's mass dropped."""
    if st.band_nosink is None:
        raise ValueError("these statistics have no local attention band (collect them with taylor_calibrate.stats)")
    return st.band_nosink.float().nan_to_num(0.0)


def constant_direction(xf: torch.Tensor, ridge: float = 1e-3, anchor: torch.Tensor | None = None) -> torch.Tensor:
    """d with mean_t x_t.d = 1 and the least variance of x_t.d over tokens: d = S^-1 mu / (mu' S^-1 mu), S the input
    covariance (ridge-regularised). fla's layer has no biases on a_proj/b_proj/g_proj; this direction lets a weight row
    act like one, so a calibrated gate level is (nearly) the same for every token. `anchor` (hidden,): an input that
    must give exactly 1 as well (d = S^-1 M (M' S^-1 M)^-1 1 with M = [mu, anchor])."""
    mu = xf.mean(0)
    cov = torch.cov(xf.T) if xf.shape[0] > 1 else torch.zeros(xf.shape[1], xf.shape[1], device=xf.device)
    cov = cov + ridge * cov.diagonal().mean().clamp_min(1e-12) * torch.eye(cov.shape[0], device=xf.device)
    m = mu[:, None] if anchor is None else torch.stack([mu, anchor.float()], 1)
    sm = torch.linalg.solve(cov, m)
    return sm @ torch.linalg.solve(m.T @ sm, torch.ones(m.shape[1], device=xf.device))


def solve_mean_sigmoid(z: torch.Tensor, u: torch.Tensor, target: float, iters: int = 60) -> float:
    """delta such that mean(sigmoid(z + delta * u)) = target (bisection; u has mean 1)."""
    lo, hi = -60.0, 60.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if torch.sigmoid(z + mid * u).mean().item() < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def swish_inverse(a: torch.Tensor) -> torch.Tensor:
    """z >= 0 with z * sigmoid(z) = a (a >= 0), by Newton from a good start."""
    z = torch.where(a > 1, a, torch.sqrt(2 * a) + a / 2)  # swish(z) ~ z/2 + z^2/4 near 0
    for _ in range(30):
        s = torch.sigmoid(z)
        f, df = z * s - a, s + z * s * (1 - s)
        z = (z - f / df).clamp_min(0)
    return z


def beta_target(st, args, paper: bool, device) -> torch.Tensor:
    """Target write gate per head: beta*_h = beta_min + beta_span * c_h."""
    return args.beta_min + args.beta_span * concentration(st, paper).to(device)
