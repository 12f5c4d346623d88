"""Phase 1 for GDN: analytic calibration of its dynamics from teacher attention statistics (docs/method.md,
"Phase 1: calibration").

Two versions, every step switchable for ablations:
- `paper`: the public reference implementation as docs/method.md ("paper") states it, quirks included.
- `taylor` (ours): docs/method.md ("taylor"), every calibrated quantity takes effect at step 0:
  decay a_proj = 0 so the half-life is exactly d_h; the *mean* write gate equals beta*_h (solved on the calibration
  inputs, not just the logits' spread); the per-head amplitude sigma_h reaches the output (through the gate's
  mean when a per-head norm would cancel it, else through o_proj); the output gate is a small perturbation around
  that amplitude; with short convs, each head's v conv holds the teacher's local attention profile (mean p_{t,t-j}
  over the conv's offsets), the part of the pattern a RoPE-free recurrence cannot express; with SiLU on v and the
  per-head norm (Qwen3.5's layer), v_proj is pre-scaled so that SiLU works where it is nearly linear.
Baselines: `copy` (weight copy, library-default dynamics) and `zero_gate` (g_proj = 0).
Each takes (mixer, st: a layer's stats.LayerStats, x, y, args: config.CalibArgs); the model package imports neither.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from taylor_calibrate.model.mixers.calibration import (beta_target, constant_direction, distance, inv_softplus,
                                                       local_band, solve_mean_sigmoid, swish_inverse)
from taylor_calibrate.model.mixers.gdn.module import GatedDeltaNet, identity_conv_



def _readout_unit(mixer: GatedDeltaNet, x: torch.Tensor, norm: bool) -> torch.Tensor:
    """Student head outputs with a unit gate: the recurrence's readout (after o_norm when `norm`)."""
    o = mixer.readout(*mixer.features(x))
    return mixer.o_norm(o) if norm and mixer.o_norm is not None else o  # (B, T, H, D)


def _sigma(mixer, x, y, norm: bool, gated: bool = False) -> torch.Tensor:
    """Per-head least squares factor sigma_h = <y_h, yhat_h> / <yhat_h, yhat_h> (docs/method.md, "Phase 1:
    calibration"); yhat through the layer's current gate when `gated`, else at unit gate."""
    yhat = (mixer.gate(x, mixer.readout(*mixer.features(x))) if gated else _readout_unit(mixer, x, norm)).float()
    y = y.float().view_as(yhat)
    return (y * yhat).sum((0, 1, 3)) / (yhat * yhat).sum((0, 1, 3)).clamp_min(1e-12)


def _set_decay(mixer: GatedDeltaNet, rate: torch.Tensor) -> None:
    """Decay rate per head: softplus(dt_bias) = rate with A_log = 0 (rate ln 2 / d_h: memory halves after d_h
    tokens)."""
    mixer.A_log.zero_()
    mixer.dt_bias.copy_(inv_softplus(rate.float()))


@torch.no_grad()
def calibrate_paper(mixer: GatedDeltaNet, st, x: torch.Tensor, y: torch.Tensor, args) -> dict:
    """The reference implementation's phase 1, quirks included (docs/method.md, "Phase 1: calibration", "paper"):
    sink counted, min-max concentration, rate clamped, a_proj left random, the write gate's spread set instead of its
    mean, sigma_h multiplied into v_proj (where o_norm cancels it), g_proj = alpha * v_proj. x: (N, T, hidden)
    teacher inputs, y: (N, T, H*D) teacher head outputs (calibration rows, on the mixer's device)."""
    p = next(mixer.parameters())
    rep: dict = {}
    if mixer.cfg.short_conv != "none":  # the reference has no conv: identity convs compute its layer
        for conv in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d):
            identity_conv_(conv)
    if args.decay:
        d = distance(st, paper=True).to(p.device)
        _set_decay(mixer, (math.log(2) / d).clamp(1e-3, 5))
        rep["half_life"] = d.tolist()
    if args.write_gate:  # sets the logits' spread, not their mean
        beta_star = beta_target(st, args, True, p.device)
        logit = torch.log(beta_star / (1 - beta_star))
        w = mixer.b_proj.weight  # (H, hidden)
        w.copy_((logit / math.sqrt(w.shape[1]))[:, None] * w / w.abs().mean(1, keepdim=True).clamp_min(1e-12))
        rep["beta_star"] = beta_star.tolist()
    rows = slice(0, args.sigma_rows)
    if args.value_scale:  # multiplied into v_proj rows, where o_norm then cancels it
        sigma = _sigma(mixer, x[rows], y[rows], norm=False).clamp(0.1, 10)
        scale = sigma.repeat_interleave(mixer.head_dim)
        mixer.v_proj.weight.mul_(scale[:, None].to(p.dtype))
        if mixer.v_proj.bias is not None:
            mixer.v_proj.bias.mul_(scale.to(p.dtype))
        rep["sigma"] = sigma.tolist()
    if args.output_gate and mixer.g_proj is not None:
        v = mixer.v_proj(x[rows]).float()
        alpha = args.gate_alpha * st.head_rms.mean().item() / F.silu(v).pow(2).mean().sqrt().clamp_min(1e-12).item()
        mixer.g_proj.weight.copy_(alpha * mixer.v_proj.weight)
        rep["gate_alpha"] = alpha
    return rep


@torch.no_grad()
def calibrate_taylor(mixer: GatedDeltaNet, st, x: torch.Tensor, y: torch.Tensor, args) -> dict:
    """Our phase 1: every calibrated quantity takes effect at step 0 (docs/method.md, "Phase 1: calibration",
    "taylor"). x: (N, T, hidden) teacher inputs, y: (N, T, H*D) teacher head outputs (calibration rows, on the
    mixer's device)."""
    H, D = mixer.num_heads, mixer.head_dim
    p = next(mixer.parameters())
    rep: dict = {}
    xf = x.float().reshape(-1, x.shape[-1])
    dvec = constant_direction(xf)  # x_t . dvec has mean 1 and the least spread over tokens: a stand-in for a bias
    u = xf @ dvec  # (tokens,)
    fan_in = mixer.b_proj.weight.shape[1]

    if args.local_profile and mixer.cfg.short_conv != "none":
        rep["local_profile"] = _set_local_profile(mixer, st).tolist()

    if args.decay:  # a_proj = 0: the half-life is exactly d_h for every token
        d = distance(st).to(p.device)
        _set_decay(mixer, math.log(2) / d)
        mixer.a_proj.weight.zero_()
        rep["half_life"] = d.tolist()

    if args.write_gate:  # shift along the mean input direction until mean_t sigmoid(logit_t) = beta*_h exactly
        beta_star = beta_target(st, args, False, p.device)
        w = mixer.b_proj.weight  # (H, hidden)
        z = xf @ w.float().T  # (tokens, H)
        for h in range(H):
            delta = solve_mean_sigmoid(z[:, h], u, beta_star[h].item())
            w[h] += (delta * dvec).to(w.dtype)
        rep["beta_star"] = beta_star.tolist()

    # after the dynamics (it measures the readout they shape), before the amplitude (which must see it)
    if args.v_prescale and mixer.cfg.v_activation == "silu" and mixer.o_norm is not None:
        s, err = prescale_v(mixer, x[:args.sigma_rows])
        rep["v_prescale"], rep["v_prescale_error"] = s.tolist(), err.tolist()

    # Amplitude takes effect. With the output gate calibrated, |sigma_h| becomes the gate's mean value and the sign
    # goes into o_proj's head-h columns; without a gate, or with `output_gate` off (g_proj keeps its library init),
    # all of sigma_h goes into those columns, measured through whatever gate is there (exact: o_proj is linear).
    rows = slice(0, args.sigma_rows)
    if args.value_scale or args.output_gate:
        has_gate = mixer.g_proj is not None and args.output_gate
        if has_gate:  # provisional gate (perturbation only) so that yhat is measured at unit scale
            mixer.g_proj.weight.zero_()
        sigma = (_sigma(mixer, x[rows], y[rows], norm=True, gated=not has_gate) if args.value_scale
                 else torch.ones(H, device=p.device))
        amp, sign = sigma.abs().clamp_min(1e-3), torch.where(sigma < 0, -1.0, 1.0)
        scale_cols = sign if has_gate else sign * amp
        if has_gate and mixer.cfg.gate == "sigmoid":  # sigmoid can only give (0, 1): centre it at 0.5, rest to o_proj
            scale_cols, z = sign * amp / 0.5, torch.zeros(H, device=p.device)
        elif has_gate:
            z = swish_inverse(amp)
        mixer.o_proj.weight.mul_(scale_cols.repeat_interleave(D)[None, :].to(p.dtype))
        if has_gate:
            g = mixer.g_proj.weight  # (H*D, hidden): constant-direction component giving gate(z_h) + perturbation
            noise = torch.randn(g.shape, generator=torch.Generator().manual_seed(mixer.layer_idx)).to(g)
            rms_in = xf.pow(2).mean().sqrt()
            zrow = z.repeat_interleave(D)[:, None]  # perturbation relative to each head's own gate level
            g.copy_(noise * (args.gate_alpha * zrow.clamp_min(1e-2) / (rms_in * math.sqrt(fan_in))))
            g += (zrow * dvec[None, :]).to(g.dtype)
        rep["sigma"] = sigma.tolist()
    return rep


def _conv_v(mixer: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """v after the short conv, before its activation: (B, T, H, D)."""
    B, T, _ = x.shape
    v = mixer.v_proj(x)
    if mixer.cfg.short_conv != "none":
        v = mixer._short_conv(v, v, v, None)[2]
    return v.view(B, T, mixer.num_heads, mixer.head_dim)


@torch.no_grad()
def prescale_v(mixer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU on v, per-head norm after the readout: scale head h's v_proj rows by s_h so that SiLU works
    where it is nearly linear, SiLU(z) = z/2 + z^2/4 + O(z^4), and the layer computes what it would with linear v
    (docs/method.md, "taylor", "v pre-scale"). The norm makes the layer blind to the scale of v up to its epsilon,
    so s_h trades the quadratic term (relative size (c/2) rho2/rho at c = s_h rms(u)) against the epsilon
    (eps / (2 ms(readout)) = 2 eps / (c rho)^2); the sum is least at c = 2 (eps / (rho rho2))^(1/3). u is the conv'd
    v, rho = rms R(u) / rms u and rho2 = rms R(u^2) / ms u with R the recurrence's readout, measured on x.
    Exact in the decode path too: v_proj is linear and comes before the conv. Returns s and the predicted relative
    error of each head's normed readout against linear v's (the sum of both terms at that c), each (H,)."""
    q, k, _, g, beta = mixer.features(x)
    u = _conv_v(mixer, x).float()
    r = u.pow(2).mean((0, 1, 3)).sqrt().clamp_min(1e-12)

    def rms_readout(v):
        return mixer.readout(q, k, v.to(q.dtype), g, beta).float().pow(2).mean((0, 1, 3)).sqrt()

    rho, rho2 = rms_readout(u) / r, rms_readout(u * u) / r ** 2
    c = 2 * (mixer.cfg.norm_eps / (rho * rho2).clamp_min(1e-30)) ** (1 / 3)
    s, err = c / r, 0.75 * c * rho2 / rho
    rows = s.repeat_interleave(mixer.head_dim).to(mixer.v_proj.weight.dtype)
    mixer.v_proj.weight.mul_(rows[:, None])
    if mixer.v_proj.bias is not None:
        mixer.v_proj.bias.mul_(rows)
    return s, err


def _set_local_profile(mixer: GatedDeltaNet, st) -> torch.Tensor:
    """v conv of head h <- the teacher's mean attention p_{t,t-j} over offsets j < K, renormalised (conv weight
    index K-1-j multiplies x_{t-j}); q / k convs <- identity. Returns the (H, K) kernel."""
    K, D = mixer.cfg.conv_size, mixer.head_dim
    band = local_band(st)
    if band.shape[1] < K:
        raise ValueError(f"the local profile needs the teacher's attention over {K} offsets; these statistics have "
                         f"{band.shape[1]}")
    prof = band[:, :K].clamp_min(0)
    total = prof.sum(1, keepdim=True)
    identity = torch.zeros_like(prof)
    identity[:, 0] = 1.0
    prof = torch.where(total > 1e-6, prof / total.clamp_min(1e-6), identity)  # no local mass: identity kernel
    w = mixer.v_conv1d.weight  # (H*D, 1, K)
    w.copy_(prof.flip(1).repeat_interleave(D, dim=0)[:, None, :].to(w))
    for conv in (mixer.q_conv1d, mixer.k_conv1d):
        identity_conv_(conv)
    return prof


def _copy(mixer: GatedDeltaNet, st, x, y, args) -> dict:
    """Weight copy only: the library-default dynamics stay."""
    return {}


@torch.no_grad()
def _zero_gate(mixer: GatedDeltaNet, st, x, y, args) -> dict:
    """Weight copy with g_proj = 0 (the reference's "zero gate" ablation row)."""
    if mixer.g_proj is None:
        raise ValueError("init zero_gate needs an output gate (gdn.gate != 'none')")
    mixer.g_proj.weight.zero_()
    return {}


CALIBRATORS = {"copy": _copy, "zero_gate": _zero_gate, "paper": calibrate_paper, "taylor": calibrate_taylor}
"""Phase 1 by method: f(mixer, layer stats, inputs, head outputs, CalibArgs) -> report, the mixer set in place."""
