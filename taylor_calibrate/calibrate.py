"""Phase 1: analytic calibration of the GDN dynamics from teacher attention statistics (docs/method.md,
"Phase 1: calibration").

Two versions, every step switchable for ablations:
- `paper`: the public reference implementation as docs/method.md ("paper") states it, quirks included.
- `taylor` (ours): docs/method.md ("taylor"), every calibrated quantity takes effect at step 0:
  decay a_proj = 0 so the half-life is exactly d_h; the *mean* write gate equals beta*_h (solved on the calibration
  inputs, not just the logits' spread); the per-head amplitude sigma_h reaches the output (through the gate's
  mean when a per-head norm would cancel it, else through o_proj); the output gate is a small perturbation around
  that amplitude; with short convs, each head's v conv holds the teacher's local attention profile (mean p_{t,t-j}
  over the conv's offsets), the part of the pattern a RoPE-free recurrence cannot express.
Baselines: `copy` (weight copy, library-default dynamics) and `zero_gate` (g_proj = 0).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from taylor_calibrate.config import CalibArgs
from taylor_calibrate.model.gdn import GatedDeltaNet, identity_conv_
from taylor_calibrate.ops import gated_delta_rule
from taylor_calibrate.stats import LayerStats

METHODS = ("copy", "zero_gate", "paper", "taylor")


def inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def concentration(st: LayerStats, args: CalibArgs) -> torch.Tensor:
    """c_h in [0, 1]: 1 = one-hot attention, 0 = uniform."""
    if args.concentration == "abs":
        c = st.concentration_abs_nosink if args.sinks == "drop" else st.concentration_abs
        return c.clamp(0, 1)
    H = st.entropy_nosink if args.sinks == "drop" else st.entropy
    return 1 - (H - H.min()) / (H.max() - H.min()).clamp_min(1e-3)


def distance(st: LayerStats, args: CalibArgs, floored: bool = False) -> torch.Tensor:
    if args.sinks == "drop":
        return st.distance_nosink.clamp_min(0.5)
    return (st.distance_floored if floored else st.distance).clamp_min(0.5)


def local_band(st: LayerStats, args: CalibArgs) -> torch.Tensor:
    """(H, BAND) mean attention p_{t,t-j} on the nearest offsets j (sink dropped or kept as `args.sinks` says)."""
    band = st.band_nosink if args.sinks == "drop" else st.band
    if band is None:
        raise ValueError("these statistics have no local attention band (collect them with taylor_calibrate.stats)")
    return band.float().nan_to_num(0.0)


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


def constant_direction(xf: torch.Tensor, ridge: float = 1e-3) -> torch.Tensor:
    """d with mean_t x_t.d = 1 and the least variance of x_t.d over tokens: d = S^-1 mu / (mu' S^-1 mu), S the input
    covariance (ridge-regularised). fla's layer has no biases on a_proj/b_proj/g_proj; this direction lets a weight row
    act like one, so a calibrated gate level is (nearly) the same for every token."""
    mu = xf.mean(0)
    cov = torch.cov(xf.T) if xf.shape[0] > 1 else torch.zeros(xf.shape[1], xf.shape[1], device=xf.device)
    cov = cov + ridge * cov.diagonal().mean().clamp_min(1e-12) * torch.eye(cov.shape[0], device=xf.device)
    d = torch.linalg.solve(cov, mu)
    return d / mu.dot(d)


def _solve_mean_sigmoid(z: torch.Tensor, u: torch.Tensor, target: float, iters: int = 60) -> float:
    """delta such that mean(sigmoid(z + delta * u)) = target (bisection; u has mean 1)."""
    lo, hi = -60.0, 60.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if torch.sigmoid(z + mid * u).mean().item() < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _swish_inverse(a: torch.Tensor) -> torch.Tensor:
    """z >= 0 with z * sigmoid(z) = a (a >= 0), by Newton from a good start."""
    z = torch.where(a > 1, a, torch.sqrt(2 * a) + a / 2)  # swish(z) ~ z/2 + z^2/4 near 0
    for _ in range(30):
        s = torch.sigmoid(z)
        f, df = z * s - a, s + z * s * (1 - s)
        z = (z - f / df).clamp_min(0)
    return z


@torch.no_grad()
def calibrate_layer(mixer: GatedDeltaNet, st: LayerStats, x: torch.Tensor, y: torch.Tensor, method: str,
                    args: CalibArgs) -> dict:
    """Calibrate one converted layer in place. x: (N, T, hidden) teacher inputs, y: (N, T, H*D) teacher head outputs
    (both calibration rows, on the mixer's device)."""
    if method not in METHODS:
        raise ValueError(f"calibration method {method!r} is not one of {METHODS}")
    H, D = mixer.num_heads, mixer.head_dim
    p = next(mixer.parameters())
    rep: dict = {}
    if method == "paper":  # the reference counts sink mass and normalises entropy over the layer's heads
        args = dataclasses.replace(args, sinks="keep", concentration="minmax")
    if method == "copy":
        return rep
    if method == "zero_gate":
        if mixer.g_proj is None:
            raise ValueError("init zero_gate needs an output gate (gdn.gate != 'none')")
        mixer.g_proj.weight.zero_()
        return rep
    xf = x.float().reshape(-1, x.shape[-1])
    dvec = constant_direction(xf)  # x_t . dvec has mean 1 and the least spread over tokens: a stand-in for a bias
    u = xf @ dvec  # (tokens,)
    fan_in = mixer.b_proj.weight.shape[1]

    profile = method == "taylor" and args.local_profile and mixer.cfg.short_conv != "none"
    if profile:
        rep["local_profile"] = _set_local_profile(mixer, st, args).tolist()
    elif method == "paper" and mixer.cfg.short_conv != "none":  # the reference has no conv: identity = its layer
        for conv in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d):
            identity_conv_(conv)

    if args.decay:  # memory halves after d_h tokens: softplus(dt_bias) = ln 2 / d_h with A_log = 0
        d = distance(st, args, floored=(method == "paper")).to(p.device)
        if profile and args.far_half_life:  # the conv covers offsets < K: the recurrence carries the rest
            d = _far_distance(st, args, mixer.cfg.conv_size).to(p.device)
        if method == "taylor":
            d = d * args.half_life_scale
        rate = math.log(2) / d
        if method == "paper":
            rate = rate.clamp(1e-3, 5)
        mixer.A_log.zero_()
        mixer.dt_bias.copy_(inv_softplus(rate.float()))
        if method == "taylor":
            mixer.a_proj.weight.zero_()
        rep["half_life"] = d.tolist()

    if args.write_gate:
        c = concentration(st, args).to(p.device)
        beta_star = args.beta_min + args.beta_span * c
        logit = torch.log(beta_star / (1 - beta_star))
        w = mixer.b_proj.weight  # (H, hidden)
        if method == "paper":  # sets the logits' spread, not their mean (reference quirk)
            w.copy_((logit / math.sqrt(fan_in))[:, None] * w / w.abs().mean(1, keepdim=True).clamp_min(1e-12))
        else:  # shift along the mean input direction until mean_t sigmoid(logit_t) = beta*_h exactly
            z = xf @ w.float().T  # (tokens, H)
            for h in range(H):
                delta = _solve_mean_sigmoid(z[:, h], u, beta_star[h].item())
                w[h] += (delta * dvec).to(w.dtype)
        rep["beta_star"] = beta_star.tolist()

    rows = slice(0, args.sigma_rows)
    if method == "taylor" and args.readout == "value":
        rep["value_fit_rel_mse"] = _fit_v_proj(mixer, x, y, args.ridge, _sigma(mixer, x[rows], y[rows], norm=False))
    if method == "paper":
        if args.value_scale:  # multiplied into v_proj rows, where o_norm then cancels it (reference quirk)
            sigma = _sigma(mixer, x[rows], y[rows], norm=False).clamp(0.1, 10)
            mixer.v_proj.weight.mul_(sigma.repeat_interleave(D)[:, None].to(p.dtype))
            if mixer.v_proj.bias is not None:
                mixer.v_proj.bias.mul_(sigma.repeat_interleave(D).to(p.dtype))
            rep["sigma"] = sigma.tolist()
        if args.output_gate and mixer.g_proj is not None:
            v = mixer.v_proj(x[rows]).float()
            alpha = args.gate_alpha * st.head_rms.mean().item() / F.silu(v).pow(2).mean().sqrt().clamp_min(1e-12).item()
            mixer.g_proj.weight.copy_(alpha * mixer.v_proj.weight)
            rep["gate_alpha"] = alpha
        return rep

    W_O = mixer.o_proj.weight.detach().clone()  # the teacher's, still untouched here
    # taylor: amplitude takes effect. With the output gate calibrated, |sigma_h| becomes the gate's mean value and
    # the sign goes into o_proj's head-h columns; without a gate, or with `output_gate` off (g_proj keeps its
    # library init), all of sigma_h goes into those columns, measured through whatever gate is there (exact: o_proj
    # is linear).
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
            z = _swish_inverse(amp)
        mixer.o_proj.weight.mul_(scale_cols.repeat_interleave(D)[None, :].to(p.dtype))
        if has_gate:
            g = mixer.g_proj.weight  # (H*D, hidden): constant-direction component giving gate(z_h) + perturbation
            noise = torch.randn(g.shape, generator=torch.Generator().manual_seed(mixer.layer_idx)).to(g)
            rms_in = xf.pow(2).mean().sqrt()
            zrow = z.repeat_interleave(D)[:, None]  # perturbation relative to each head's own gate level
            g.copy_(noise * (args.gate_alpha * zrow.clamp_min(1e-2) / (rms_in * math.sqrt(fan_in))))
            g += (zrow * dvec[None, :]).to(g.dtype)
        rep["sigma"] = sigma.tolist()
    if args.readout == "lstsq":
        target = F.linear(y.to(W_O.dtype), W_O)  # teacher attention output minus o_proj's bias
        rep["readout_rel_mse"] = _fit_o_proj(mixer, x, target, args.ridge)
    return rep


def _set_local_profile(mixer: GatedDeltaNet, st: LayerStats, args: CalibArgs) -> torch.Tensor:
    """v conv of head h <- the teacher's mean attention p_{t,t-j} over offsets j < K, renormalised (conv weight
    index K-1-j multiplies x_{t-j}); q / k convs <- identity. Returns the (H, K) kernel."""
    K, D = mixer.cfg.conv_size, mixer.head_dim
    band = local_band(st, args)
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


def _far_distance(st: LayerStats, args: CalibArgs, K: int) -> torch.Tensor:
    """Mean distance of the attention mass at offsets >= K: (d_h - sum_{j<K} j b_j) / (1 - sum_{j<K} b_j)."""
    band = local_band(st, args)[:, :K]
    near = band @ torch.arange(K, dtype=torch.float32)
    far = (1 - band.sum(1)).clamp_min(1e-3)
    return ((distance(st, args).float() - near) / far).clamp_min(float(K))


def _fit_v_proj(mixer: GatedDeltaNet, x: torch.Tensor, y: torch.Tensor, ridge: float, scale: torch.Tensor) -> dict:
    """Closed-form v_proj, per head: with the decay, write gate, q and k fixed, the recurrence's readout is linear in
    the values (o_t = sum_s w_ts v_s), so o_t = W_h z_t with z_t = sum_s w_ts x_s, the same recurrence run on the raw
    inputs. Ridge least squares of W_h from z to the teacher's head output y_h / scale_h (scale_h: the pre-norm
    sigma_h, so W_h keeps the copied W_V's size and the ridge shrinks toward it), bias column included. Unlike the
    lstsq o_proj it keeps W_O and the teacher's head layout: each head is fitted to its own teacher head. Returns
    the fit's squared error relative to the targets' energy before and after, on the calibration rows."""
    if mixer.cfg.v_activation != "identity" or mixer.cfg.short_conv != "none":
        raise ValueError("--calib.readout value needs a readout linear in v_proj: --gdn.v_activation identity and "
                         "--gdn.short_conv none")
    H, D = mixer.num_heads, mixer.head_dim
    w, b = mixer.v_proj.weight, mixer.v_proj.bias
    P = w.shape[1] + (b is not None)
    A = torch.zeros(H, P, P, device=w.device)
    B = torch.zeros(H, P, D, device=w.device)
    yy = torch.zeros((), device=w.device)
    s = scale.float().abs().clamp_min(1e-6) * torch.where(scale < 0, -1.0, 1.0)
    for i in range(x.shape[0]):  # one row at a time bounds the memory: z is (T, H, hidden)
        xi = x[i:i + 1]
        q, k, _, g, beta = mixer.features(xi)
        xin = xi if b is None else torch.cat([xi, torch.ones_like(xi[..., :1])], -1)
        z, _ = gated_delta_rule(q, k, xin[:, :, None, :].expand(-1, -1, H, -1).contiguous(), g, beta,
                                scale=D ** -0.5, backend="torch")
        Z = z[0].float().transpose(0, 1)  # (H, T, P)
        Y = y[i].float().view(-1, H, D).transpose(0, 1) / s[:, None, None]  # (H, T, D)
        A += Z.transpose(1, 2) @ Z
        B += Z.transpose(1, 2) @ Y
        yy += Y.pow(2).sum()
    W0 = w.float().view(H, D, -1)
    if b is not None:
        W0 = torch.cat([W0, b.float().view(H, D, 1)], -1)
    W0 = W0.transpose(1, 2)  # (H, P, D)
    sse0 = (W0.transpose(1, 2) @ A @ W0).diagonal(dim1=1, dim2=2).sum() - 2 * (W0 * B).sum()
    lam = ridge * A.diagonal(dim1=1, dim2=2).mean(-1)  # (H,)
    W = torch.linalg.solve(A + lam[:, None, None] * torch.eye(P, device=A.device), B + lam[:, None, None] * W0)
    sse = (W.transpose(1, 2) @ A @ W).diagonal(dim1=1, dim2=2).sum() - 2 * (W * B).sum()
    w.copy_(W[:, :w.shape[1]].transpose(1, 2).reshape(H * D, -1).to(w.dtype))
    if b is not None:
        b.copy_(W[:, -1].reshape(-1).to(b.dtype))
    return {"before": ((yy + sse0) / yy).item(), "after": ((yy + sse) / yy).item()}


def _fit_o_proj(mixer: GatedDeltaNet, x: torch.Tensor, target: torch.Tensor, ridge: float) -> float:
    """Closed-form o_proj: ridge least squares from the student's gated head outputs to the teacher's attention
    output, shrunk toward the current o_proj. The per-head sigma_h is its diagonal special case. Phase 2 trains
    o_proj slowly (lr_o), so the fit to phase 1's features mostly stays: a far better start that ends worse
    (docs/decisions.md, "readout"). Returns the fit's relative MSE on the calibration rows."""
    feats, tgt = [], []
    for i in range(x.shape[0]):  # one row at a time bounds the memory of the student forward
        xi = x[i:i + 1]
        feats.append(mixer.gate(xi, mixer.readout(*mixer.features(xi))).flatten(2).flatten(0, 1).float())
        tgt.append(target[i].float())
    Fm, Y = torch.cat(feats), torch.cat(tgt)  # (M, H*D), (M, hidden)
    W0 = mixer.o_proj.weight.float()  # (hidden, H*D)
    A = Fm.T @ Fm
    lam = ridge * A.diagonal().mean()
    W = torch.linalg.solve(A + lam * torch.eye(A.shape[0], device=A.device), Fm.T @ Y + lam * W0.T).T
    mixer.o_proj.weight.copy_(W.to(mixer.o_proj.weight.dtype))
    return ((Fm @ W.T - Y).pow(2).mean() / Y.var()).item()
