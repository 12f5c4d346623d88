"""Phase 1 (docs/method.md, "Phase 1: calibration": "taylor" and "paper"): every calibrated quantity of the `taylor`
method takes effect at step 0, measured on the calibrated mixer's own intermediate quantities; the `paper` baseline
reproduces the reference's quirks; `copy` and `zero_gate` are what they say.

Teachers are tiny llamas with realistic weight scales (initializer 0.2: peaked attention, head outputs of order 1)
and query heads of different sharpness (so concentrations, hence beta*, differ per head). `teacher` also gives its
embeddings a shared direction, as real LMs' residual streams have one: the attention inputs of SmolLM2-135M have
std(x.mu/|mu|^2) ~ 0.1 over tokens; `plain_teacher` does not (std ~ 0.6).
"""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import decoded_logits, one_thread, tiny_teacher

from taylor_calibrate.model.mixers.calibration import concentration, distance, inv_softplus
from taylor_calibrate.model.mixers.gdn.calibrate import calibrate_paper, calibrate_taylor
from taylor_calibrate.config import CalibArgs, GDNConfig
from taylor_calibrate.calibrate import calibrated_mixers
from taylor_calibrate.model.hybrid import convert_teacher, make_mixers
from taylor_calibrate.stats import collect_stats

LAYERS = [1, 2]
H, D = 4, 16
ROWS = CalibArgs().sigma_rows  # sigma_h is fitted on the first rows; the least-squares checks use the same rows


pytestmark = pytest.mark.usefixtures("single_thread")


def _llama(shared_direction: float):
    model = tiny_teacher("llama", initializer_range=0.2)
    with torch.no_grad():
        for layer in model.model.layers:  # head h's scores x (0.5, 1, 2, 3): flat to peaked heads
            layer.self_attn.q_proj.weight.view(H, D, -1).mul_(torch.tensor([0.5, 1.0, 2.0, 3.0])[:, None, None])
        emb = model.model.embed_tokens.weight
        e = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(5))
        emb += shared_direction * emb.norm(dim=1).mean() * e / e.norm()
    return model


def _setup(shared_direction: float):
    with one_thread():
        model = _llama(shared_direction)
        ids = torch.randint(0, model.config.vocab_size, (8, 64), generator=torch.Generator().manual_seed(1))
        return model, collect_stats(model, ids, store_layers=LAYERS)


@pytest.fixture(scope="module")
def teacher():
    return _setup(shared_direction=3.0)


@pytest.fixture(scope="module")
def plain_teacher():
    return _setup(shared_direction=0.0)


def _calibrated(model, stats, method="taylor", calib=None, gdn=None):
    mixers, report = calibrated_mixers(model, stats, LAYERS, method, calib or CalibArgs(), gdn or GDNConfig(), "torch")
    return mixers, report


def _column_scale(mixer, attn) -> torch.Tensor:
    """(H,) factors s_h with mixer.o_proj = teacher o_proj x s_h on head h's columns; checks that is all it is."""
    w, wt = mixer.o_proj.weight.view(-1, H, D), attn.o_proj.weight.view(-1, H, D)
    s = (w * wt).sum((0, 2)) / (wt * wt).sum((0, 2))
    torch.testing.assert_close(w, wt * s[None, :, None], rtol=1e-5, atol=1e-7)
    return s


@torch.no_grad()
def _student_heads(mixer, attn, x):
    """Student head outputs in the teacher's o_proj basis: o_proj's per-head column factor folded into the gated
    readout, so o_proj_student(o) = o_proj_teacher(returned). (B, T, H, D); also the gate values alone."""
    o = mixer.readout(*mixer.features(x))
    gated = mixer.gate(x, o)
    gate = gated / mixer.o_norm(o) if mixer.o_norm is not None else gated / o
    return gated * _column_scale(mixer, attn)[:, None], gate


def _least_squares(y, s):
    """Per head: LS factor <y, s>/<s, s>, uncentred correlation, RMS(s)/RMS(y)."""
    ys, ss, yy = (y * s).sum((0, 1, 3)), (s * s).sum((0, 1, 3)), (y * y).sum((0, 1, 3))
    return ys / ss, ys / (ss * yy).sqrt(), (ss / yy).sqrt()


# ----------------------------------------------------------------------------- taylor: decay


def test_taylor_decay_halves_memory_after_d_tokens(teacher):
    model, stats = teacher
    mixers, report = _calibrated(model, stats)
    for i, mixer in mixers.items():
        st = stats.layers[i]
        d = distance(st)
        want = st.distance_nosink.clamp_min(0.5)  # the sink's mass dropped
        torch.testing.assert_close(d, want)
        assert (d > 1).all() and d.std() > 0.1, "distances must differ per head for the test to mean something"
        assert not mixer.a_proj.weight.any()
        _, _, _, g, _ = mixer.features(stats.inputs[i])
        gamma = g.exp()  # (N, T, H) per-token decay
        assert torch.equal(gamma, gamma[:1, :1].expand_as(gamma)), "decay must not depend on the token"
        torch.testing.assert_close(gamma[0, 0] ** d, torch.full((H,), 0.5), rtol=0, atol=1e-4)
        assert report[i]["half_life"] == pytest.approx(d.tolist())


# ----------------------------------------------------------------------------- taylor: local profile (short conv)


def test_taylor_local_profile_takes_effect(teacher):
    """With short convs, head h's conv output on v is the teacher's mean local attention over the K nearest
    offsets applied to the values (renormalised), and q / k pass through unchanged."""
    model, stats = teacher
    K = 4
    mixers, report = _calibrated(model, stats, gdn=GDNConfig(short_conv="random", conv_size=K))
    for i, mixer in mixers.items():
        st = stats.layers[i]
        band = st.band_nosink[:, :K]
        prof = band / band.sum(1, keepdim=True)
        assert (band.sum(1) > 0.05).all() and prof.std(0).max() > 0.01, "profiles must differ for the test to mean it"
        torch.testing.assert_close(torch.tensor(report[i]["local_profile"]), prof)
        x = stats.inputs[i][:2]
        q, k, v = mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)
        cq, ck, cv = mixer._short_conv(q, k, v, None)
        torch.testing.assert_close(cq, q)
        torch.testing.assert_close(ck, k)
        want = sum(prof[:, j].repeat_interleave(D) * F.pad(v, (0, 0, j, 0))[:, :v.shape[1]] for j in range(K))
        torch.testing.assert_close(cv, want, rtol=1e-5, atol=1e-6)


def test_paper_convs_are_identity_so_its_layer_is_the_references(teacher):
    """The reference has no short conv: with convs on, paper's layer computes exactly what the conv-free one does."""
    model, stats = teacher
    conv, _ = _calibrated(model, stats, method="paper", gdn=GDNConfig(short_conv="random"))
    none, _ = _calibrated(model, stats, method="paper", gdn=GDNConfig(short_conv="none"))
    for i in LAYERS:
        x = stats.inputs[i][:2]
        with torch.no_grad():
            torch.testing.assert_close(conv[i](x)[0], none[i](x)[0])


def test_local_profile_off_keeps_the_library_conv(teacher):
    model, stats = teacher
    gdn = GDNConfig(short_conv="identity")
    on, _ = _calibrated(model, stats, gdn=gdn)
    off, report = _calibrated(model, stats, calib=CalibArgs(local_profile=False), gdn=gdn)
    for i in LAYERS:
        assert "local_profile" not in report[i]
        w = off[i].v_conv1d.weight
        assert torch.equal(w[..., -1], torch.ones_like(w[..., -1])) and not w[..., :-1].any()
        assert not torch.equal(on[i].v_conv1d.weight, w)


# ----------------------------------------------------------------------------- taylor: write gate


def test_taylor_mean_write_gate_is_beta_star(teacher):
    model, stats = teacher
    calib = CalibArgs()
    mixers, report = _calibrated(model, stats, calib=calib)
    for i, mixer in mixers.items():
        st = stats.layers[i]
        c = st.concentration_abs_nosink.clamp(0, 1)  # absolute normalisation, the sink's mass dropped
        torch.testing.assert_close(concentration(st), c)
        beta_star = calib.beta_min + calib.beta_span * c
        assert beta_star.max() - beta_star.min() > 0.05, "beta* must differ per head for the test to mean something"
        _, _, _, _, beta = mixer.features(stats.inputs[i])  # every calibration token
        torch.testing.assert_close(beta.mean((0, 1)), beta_star, rtol=0, atol=0.02)
        torch.testing.assert_close(beta.mean((0, 1)), beta_star, rtol=0, atol=1e-3)  # solved, not approximated
        assert report[i]["beta_star"] == pytest.approx(beta_star.tolist())


# ----------------------------------------------------------------------------- taylor: amplitude and output gate


def test_taylor_amplitude_is_absorbed(teacher):
    """After calibration the student's gated head output is its own least-squares fit to the teacher's: LS factor 1,
    equivalently RMS(student)/RMS(teacher) = corr(teacher, student) (both are <y,s> = <s,s>)."""
    model, stats = teacher
    mixers, report = _calibrated(model, stats)
    for i, mixer in mixers.items():
        attn = model.model.layers[i].self_attn
        x, y = stats.inputs[i][:ROWS], stats.head_outputs[i][:ROWS].view(ROWS, -1, H, D)
        s, _ = _student_heads(mixer, attn, x)
        assert torch.equal(_column_scale(mixer, attn).abs(), torch.ones(H)), "with a gate, o_proj only takes the sign"
        ls, corr, ratio = _least_squares(y, s)
        assert (corr > 0.05).all(), f"layer {i}: student and teacher heads must correlate (sign folded in): {corr}"
        torch.testing.assert_close(ls, torch.ones(H), rtol=0, atol=0.05, msg=lambda m: f"layer {i} LS factor: {m}")
        torch.testing.assert_close(ratio, corr, rtol=0.1, atol=0, msg=lambda m: f"layer {i} RMS ratio vs corr: {m}")
        # and the amplitude did change the output: a unit-scale student would be far off
        assert (torch.tensor(report[i]["sigma"]).abs() - 1).abs().max() > 0.2


def test_taylor_output_gate_is_a_small_perturbation(teacher):
    model, stats = teacher
    mixers, report = _calibrated(model, stats)
    for i, mixer in mixers.items():
        _, gate = _student_heads(mixer, model.model.layers[i].self_attn, stats.inputs[i])
        mean, std = gate.mean((0, 1, 3)), gate.std((0, 1, 3))
        assert (std < 0.2 * mean).all(), f"layer {i}: gate std {std} vs mean {mean}"
        torch.testing.assert_close(mean, torch.tensor(report[i]["sigma"]).abs(), rtol=0.1, atol=0)
        assert mixer.g_proj.weight.std() > 0, "a perturbation, not a constant"


@pytest.mark.xfail(strict=True, reason=(
    "a limitation, not a slip: fla's g_proj has no bias, so the gate level rides on the input direction with the "
    "least spread (calibrate.constant_direction). This tiny random model's inputs have no strong shared component, "
    "so even the best direction leaves gate std/mean ~0.5; real teachers have one (SmolLM2: ~0.1)"))
def test_taylor_amplitude_without_a_shared_input_direction(plain_teacher):
    model, stats = plain_teacher
    mixers, _ = _calibrated(model, stats)
    for i, mixer in mixers.items():
        attn = model.model.layers[i].self_attn
        x, y = stats.inputs[i][:ROWS], stats.head_outputs[i][:ROWS].view(ROWS, -1, H, D)
        s, gate = _student_heads(mixer, attn, x)
        assert (gate.std((0, 1, 3)) < 0.2 * gate.mean((0, 1, 3))).all()
        ls, _, _ = _least_squares(y, s)
        torch.testing.assert_close(ls, torch.ones(H), rtol=0, atol=0.05)


def test_taylor_gate_perturbation_is_small_for_a_quiet_head(teacher):
    model, stats = teacher
    i = LAYERS[0]
    mixer = make_mixers(model, [i], GDNConfig())[i]
    y = stats.head_outputs[i].clone().view(8, -1, H, D)
    y[:, :, 0] *= 0.01  # a quiet head
    y = y.view(8, -1, H * D)
    report = calibrate_taylor(mixer, stats.layers[i], stats.inputs[i], y, CalibArgs())
    assert abs(report["sigma"][0]) < 0.03
    s, gate = _student_heads(mixer, model.model.layers[i].self_attn, stats.inputs[i][:ROWS])
    assert (gate.std((0, 1, 3)) < 0.2 * gate.mean((0, 1, 3))).all()
    ls, _, _ = _least_squares(y[:ROWS].view(ROWS, -1, H, D), s)
    torch.testing.assert_close(ls, torch.ones(H), rtol=0, atol=0.05)


def test_taylor_sigmoid_gate_absorbs_the_amplitude_on_any_inputs(plain_teacher):
    """sigmoid gate: centred at 0.5 (no mean-direction component), the amplitude goes to o_proj's columns."""
    model, stats = plain_teacher
    mixers, report = _calibrated(model, stats, gdn=GDNConfig(gate="sigmoid"))
    for i, mixer in mixers.items():
        attn = model.model.layers[i].self_attn
        x, y = stats.inputs[i][:ROWS], stats.head_outputs[i][:ROWS].view(ROWS, -1, H, D)
        torch.testing.assert_close(_column_scale(mixer, attn), torch.tensor(report[i]["sigma"]) / 0.5)
        s, gate = _student_heads(mixer, attn, x)
        assert (gate.std((0, 1, 3)) < 0.2 * gate.mean((0, 1, 3))).all()
        ls, corr, ratio = _least_squares(y, s)
        torch.testing.assert_close(ls, torch.ones(H), rtol=0, atol=0.05)
        torch.testing.assert_close(ratio, corr, rtol=0.1, atol=0)


@pytest.mark.parametrize("norm", [True, False])
def test_taylor_without_gate_puts_sigma_in_o_proj_exactly(plain_teacher, norm):
    model, stats = plain_teacher
    mixers, report = _calibrated(model, stats, gdn=GDNConfig(gate="none", output_norm=norm))
    for i, mixer in mixers.items():
        attn = model.model.layers[i].self_attn
        assert mixer.g_proj is None
        torch.testing.assert_close(_column_scale(mixer, attn), torch.tensor(report[i]["sigma"]))
        s, _ = _student_heads(mixer, attn, stats.inputs[i][:ROWS])
        ls, corr, ratio = _least_squares(stats.head_outputs[i][:ROWS].view(ROWS, -1, H, D), s)
        torch.testing.assert_close(ls, torch.ones(H), rtol=1e-4, atol=0)
        torch.testing.assert_close(ratio, corr.abs(), rtol=1e-4, atol=0)


def test_taylor_output_gate_off_keeps_the_library_gate_and_puts_sigma_in_o_proj(teacher):
    """output_gate=False leaves g_proj as copy initialised it; the amplitude then goes into o_proj's columns,
    measured through that gate, and still takes effect exactly (LS factor 1)."""
    model, stats = teacher
    copied = make_mixers(model, LAYERS, GDNConfig())
    mixers, report = _calibrated(model, stats, calib=CalibArgs(output_gate=False))
    for i, mixer in mixers.items():
        attn = model.model.layers[i].self_attn
        assert torch.equal(mixer.g_proj.weight, copied[i].g_proj.weight)
        torch.testing.assert_close(_column_scale(mixer, attn), torch.tensor(report[i]["sigma"]))
        s, _ = _student_heads(mixer, attn, stats.inputs[i][:ROWS])
        ls, _, _ = _least_squares(stats.head_outputs[i][:ROWS].view(ROWS, -1, H, D), s)
        torch.testing.assert_close(ls, torch.ones(H), rtol=1e-4, atol=0)


def test_taylor_value_scale_off_leaves_unit_amplitude(teacher):
    model, stats = teacher
    mixers, report = _calibrated(model, stats, calib=CalibArgs(value_scale=False))
    for i, mixer in mixers.items():
        assert report[i]["sigma"] == [1.0] * H
        torch.testing.assert_close(_column_scale(mixer, model.model.layers[i].self_attn), torch.ones(H))


# ----------------------------------------------------------------------------- taylor: SiLU on v (Qwen3.5's layer)


def _normed_readout(mixer, x):
    with torch.no_grad():
        return mixer.o_norm(mixer.readout(*mixer.features(x))).float()


def _head_rel_err(a, ref):
    """Per head: RMS(a - ref) / RMS(ref) over rows, tokens and the head dim."""
    return ((a - ref).pow(2).mean((0, 1, 3)) / ref.pow(2).mean((0, 1, 3))).sqrt()


def test_taylor_v_prescale_makes_silu_v_compute_linear_v(teacher):
    """SiLU on v with the per-head norm (the tiny teacher's epsilon, as --target qwen3_5 sets): the pre-scale makes
    each head's normed readout that of the same layer with linear v, within twice the error its choice of scale
    predicts (a first-order sum over the readout's mean square; the epsilon weighs most on the tokens with the
    smallest readout, hence the factor 2); without the pre-scale the error is several times larger."""
    model, stats = teacher
    eps = model.config.rms_norm_eps
    linear, _ = _calibrated(model, stats, gdn=GDNConfig(v_activation="identity", norm_eps=eps))
    scaled, report = _calibrated(model, stats, gdn=GDNConfig(v_activation="silu", norm_eps=eps))
    raw, raw_report = _calibrated(model, stats, calib=CalibArgs(v_prescale=False),
                                  gdn=GDNConfig(v_activation="silu", norm_eps=eps))
    for i in LAYERS:
        assert "v_prescale" not in raw_report[i]
        x = stats.inputs[i][:ROWS]
        ref = _normed_readout(linear[i], x)
        err, err_raw = _head_rel_err(_normed_readout(scaled[i], x), ref), _head_rel_err(_normed_readout(raw[i], x), ref)
        predicted = torch.tensor(report[i]["v_prescale_error"])
        assert (err <= 2 * predicted).all(), (err, predicted)
        assert err_raw.mean() > 2.5 * err.mean(), (err_raw, err)


def test_taylor_v_prescale_scales_only_v_proj_rows(teacher):
    """The pre-scale is s_h on head h's v_proj rows and nothing else of the copied projections; linear v or no
    per-head norm gets none."""
    model, stats = teacher
    gdn = GDNConfig(v_activation="silu")
    scaled, report = _calibrated(model, stats, gdn=gdn)
    raw, _ = _calibrated(model, stats, calib=CalibArgs(v_prescale=False), gdn=gdn)
    for i in LAYERS:
        s = torch.tensor(report[i]["v_prescale"])
        ratio = (scaled[i].v_proj.weight / raw[i].v_proj.weight).view(H, D, -1)
        torch.testing.assert_close(ratio, s[:, None, None].expand_as(ratio), rtol=1e-4, atol=0)
        for name in ("q_proj", "k_proj", "q_conv1d", "k_conv1d", "v_conv1d", "a_proj", "b_proj"):
            assert torch.equal(getattr(scaled[i], name).weight, getattr(raw[i], name).weight), name
    for gdn in (GDNConfig(v_activation="identity"), GDNConfig(v_activation="silu", output_norm=False)):
        _, report = _calibrated(model, stats, gdn=gdn)
        assert all("v_prescale" not in report[i] for i in LAYERS)


def test_taylor_v_prescaled_hybrid_decodes_as_it_runs_whole(teacher):
    """The pre-scaled v_proj (before the local-profile v conv) in a hybrid: cached decoding gives the full forward's
    logits; the conv cache holds the scaled v_proj outputs, so nothing else has to know the scale."""
    model, stats = teacher
    gdn = GDNConfig(v_activation="silu", norm_eps=model.config.rms_norm_eps)
    mixers, report = _calibrated(model, stats, gdn=gdn)
    assert all("v_prescale" in report[i] for i in LAYERS)
    hybrid = convert_teacher(model, LAYERS, gdn, mixers=mixers)
    ids = torch.randint(0, model.config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = hybrid(ids, use_cache=False).logits
        torch.testing.assert_close(decoded_logits(hybrid, ids, 17), full, rtol=1e-4, atol=1e-4)


def test_calibration_is_deterministic(teacher):
    model, stats = teacher
    a, _ = _calibrated(model, stats)
    b, _ = _calibrated(model, stats)
    for i in LAYERS:
        sa, sb = a[i].state_dict(), b[i].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


# ----------------------------------------------------------------------------- paper: the reference's quirks


@pytest.fixture(scope="module")
def paper(teacher):
    model, stats = teacher
    with one_thread():
        copied = make_mixers(model, LAYERS, GDNConfig())
        mixers, report = _calibrated(model, stats, "paper")
    return model, stats, copied, mixers, report


def test_paper_decay(paper):
    _, stats, copied, mixers, _ = paper
    for i, mixer in mixers.items():
        d_floored = stats.layers[i].distance_floored.clamp_min(0.5)  # sinks kept, distances floored at 0.5
        want = (math.log(2) / d_floored).clamp(1e-3, 5)
        torch.testing.assert_close(mixer.dt_bias.data, inv_softplus(want))
        torch.testing.assert_close(F.softplus(mixer.dt_bias.data), want)
        assert not mixer.A_log.any()
        assert torch.equal(mixer.a_proj.weight, copied[i].a_proj.weight), "a_proj stays random"
        assert mixer.a_proj.weight.abs().min() > 0


def test_paper_decay_clamps_the_rate():
    from taylor_calibrate.stats import LayerStats

    d = torch.tensor([0.01, 0.5, 1e4, 20.0])  # floored at 0.5 first; rate ln2/d: 1.39, 1.39, 7e-5 -> 1e-3, 0.035
    z = torch.zeros(4)
    st = LayerStats(distance=d, distance_floored=d, entropy=z, concentration_abs=z, distance_nosink=d,
                    entropy_nosink=z, concentration_abs_nosink=z, sink_mass=z, head_rms=torch.ones(4))
    model = tiny_teacher("llama")
    mixer = make_mixers(model, [0], GDNConfig())[0]
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    calibrate_paper(mixer, st, x, torch.randn(2, 8, H * D), CalibArgs(write_gate=False, value_scale=False,
                                                                      output_gate=False))
    want = torch.tensor([math.log(2) / 0.5, math.log(2) / 0.5, 1e-3, math.log(2) / 20])
    torch.testing.assert_close(F.softplus(mixer.dt_bias.data), want)


def test_paper_write_gate_sets_the_spread_not_the_mean(paper):
    _, stats, copied, mixers, _ = paper
    for i, mixer in mixers.items():
        st = stats.layers[i]
        c = 1 - (st.entropy - st.entropy.min()) / (st.entropy.max() - st.entropy.min())  # min-max, sinks kept
        logit = torch.logit(0.3 + 0.4 * c)
        w, w0 = mixer.b_proj.weight, copied[i].b_proj.weight
        fan_in = w.shape[1]
        torch.testing.assert_close(w.abs().mean(1), logit.abs() / math.sqrt(fan_in))
        ratio = w / w0  # each row is the random row rescaled, its sign the logit's
        torch.testing.assert_close(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-4, atol=0)
        assert torch.equal(ratio[:, 0].sign(), logit.sign())


def test_paper_output_gate_is_a_multiple_of_v_proj(paper):
    _, stats, _, mixers, report = paper
    for i, mixer in mixers.items():
        g, v = mixer.g_proj.weight, mixer.v_proj.weight
        alpha = (g * v).sum() / (v * v).sum()
        torch.testing.assert_close(g, alpha * v, rtol=1e-5, atol=1e-8)
        assert alpha > 0 and report[i]["gate_alpha"] == pytest.approx(alpha.item(), rel=1e-5)
        # alpha = 0.01 RMS(teacher head output) / RMS(silu(v)) on the calibration rows
        x = stats.inputs[i][:ROWS]
        with torch.no_grad():
            rms_v = F.silu(mixer.v_proj(x)).pow(2).mean().sqrt()
        rms_y = stats.head_outputs[i].pow(2).mean().sqrt()
        assert alpha.item() == pytest.approx(0.01 * rms_y.item() / rms_v.item(), rel=0.1)


def test_paper_value_scale_goes_into_v_proj_where_o_norm_cancels_it(paper):
    model, stats, copied, mixers, report = paper
    for i, mixer in mixers.items():
        sigma = torch.tensor(report[i]["sigma"])
        assert ((sigma >= 0.1) & (sigma <= 10)).all()
        ratio = (mixer.v_proj.weight / copied[i].v_proj.weight).view(H, D, -1)
        torch.testing.assert_close(ratio, sigma[:, None, None].expand_as(ratio), rtol=1e-5, atol=0)


def test_paper_value_scale_is_cancelled_by_o_norm(teacher):
    """The quirk: with linear values (v_activation identity) the per-head norm undoes sigma; the student's
    output then only changes through g_proj = alpha * v_proj."""
    model, stats = teacher
    gdn = GDNConfig(v_activation="identity", norm_eps=1e-10)  # up to the eps, which small sigma would feel
    scaled, report = _calibrated(model, stats, "paper", CalibArgs(output_gate=False), gdn=gdn)
    unscaled, _ = _calibrated(model, stats, "paper", CalibArgs(output_gate=False, value_scale=False), gdn=gdn)
    for i in LAYERS:
        assert max(abs(math.log(s)) for s in report[i]["sigma"]) > 0.5, "sigma must be far from 1 to mean something"
        x = stats.inputs[i][:2]
        with torch.no_grad():
            a = scaled[i].gate(x, scaled[i].readout(*scaled[i].features(x)))
            b = unscaled[i].gate(x, unscaled[i].readout(*unscaled[i].features(x)))
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- baselines and options


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_copy_is_make_mixers(teacher):
    model, _ = teacher
    mixers, report = calibrated_mixers(model, None, LAYERS, "copy", CalibArgs(), GDNConfig(), "torch")
    reference = make_mixers(model, LAYERS, GDNConfig())
    assert report == {} and sorted(mixers) == LAYERS
    assert all(_same_state(mixers[i], reference[i]) for i in LAYERS)


def test_zero_gate_zeroes_only_g_proj(teacher):
    model, stats = teacher
    mixers, _ = _calibrated(model, stats, "zero_gate")
    reference = make_mixers(model, LAYERS, GDNConfig())
    for i in LAYERS:
        assert not mixers[i].g_proj.weight.any() and reference[i].g_proj.weight.any()
        reference[i].g_proj.weight.data.zero_()
        assert _same_state(mixers[i], reference[i])
    with pytest.raises(ValueError, match="zero_gate needs an output gate"):
        _calibrated(model, stats, "zero_gate", gdn=GDNConfig(gate="none"))


@pytest.mark.parametrize("kw, match", [
    ({"beta_min": 0.0}, "0 < beta_min, 0 <= beta_span and beta_min \\+ beta_span < 1"),
    ({"beta_min": 0.5, "beta_span": 0.5}, "beta_min \\+ beta_span < 1"),
    ({"beta_span": -0.1}, "beta_min"),
])
def test_calib_args_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        CalibArgs(**kw)
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(CalibArgs(), **kw)


def test_unknown_method_is_an_error(teacher):
    model, stats = teacher
    with pytest.raises(ValueError, match="magic"):
        _calibrated(model, stats, "magic")
