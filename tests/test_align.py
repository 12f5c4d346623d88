"""Phase 2 alignment (taylor_calibrate/align.py) on a tiny random Llama teacher, CPU."""
import math

import pytest
import torch

from taylor_calibrate import GDNConfig, convert_teacher
from taylor_calibrate.align import (AlignArgs, TUNED_RMS, align_layers, batch_indices, lr_factor, rel_mse,
                                    resolve_lr_scale, teacher_lr_scale)
from conftest import tiny_teacher

LAYERS = (1, 2)
N, T = 6, 32
FAST = dict(steps=60, lr=1e-2, lr_qkv=1e-3, batch_size=2, log_every=10)
SHORT = dict(steps=3, batch_size=4, lr_qkv=1e-3, log_every=3)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These shapes are far too small for intra-op threads; with a busy CPU, spinning OpenMP workers made the
    module 100x slower. One thread keeps it fast and unaffected by other load."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def teacher_data(one_thread):
    """Teacher inputs to / outputs of self_attn of layers 1 and 2, captured by hooks on random token rows."""
    teacher = tiny_teacher("llama")
    ids = torch.randint(0, teacher.config.vocab_size, (N, T), generator=torch.Generator().manual_seed(0))
    inputs, targets, handles = {}, {}, []
    for i in LAYERS:
        attn = teacher.model.layers[i].self_attn

        def pre(module, args, kwargs, i=i):
            inputs[i] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach().clone()

        def post(module, args, kwargs, output, i=i):
            targets[i] = output[0].detach().clone()

        handles += [attn.register_forward_pre_hook(pre, with_kwargs=True),
                    attn.register_forward_hook(post, with_kwargs=True)]
    with torch.no_grad():
        teacher(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    return teacher, inputs, targets


def fresh_mixers(teacher):
    return convert_teacher(teacher, list(LAYERS), GDNConfig()).gdn_mixers


def test_alignment_lowers_rel_mse_and_reports_it(teacher_data):
    teacher, inputs, targets = teacher_data
    mixers = fresh_mixers(teacher)
    mixers[2].q_proj.weight.requires_grad_(False)  # a non-default flag: must come back as it was
    mixers[1].train()  # and a non-default mode
    flags = {l: {n: p.requires_grad for n, p in m.named_parameters()} for l, m in mixers.items()}
    frozen = {l: {n: p.detach().clone() for n, p in m.named_parameters() if n.startswith("o_norm")}
              for l, m in mixers.items()}  # o_norm is frozen by default; o_proj trains (docs/decisions.md)
    trained = {l: {n: p.detach().clone() for n, p in m.named_parameters() if not n.startswith("o_norm")}
               for l, m in mixers.items()}

    report = align_layers(mixers, inputs, targets, AlignArgs(**FAST))

    assert report["steps"] == 60 and report["tokens_per_step"] == 2 * T and report["eval_rows"] == 4
    for l, m in mixers.items():
        r = report["layers"][l]
        assert r["diverged_at"] is None
        assert r["rel_mse_after"] < 0.7 * r["rel_mse_before"], r
        assert 0 < r["best_step"] <= 60 and r["best_step"] % 10 == 0
        assert r["best_train_loss"] is not None and 1 <= r["best_train_step"] <= 60
        # the report's numbers are what a plain recomputation on the first 4 rows gives
        with torch.no_grad():
            x, y = inputs[l][:4], targets[l][:4]
            direct = ((m(x)[0] - y).pow(2).mean() / y.var(unbiased=False)).item()
        assert math.isclose(r["rel_mse_after"], direct, rel_tol=1e-5)
        assert math.isclose(rel_mse(m, x, y), direct, rel_tol=1e-5)
        for n, p in m.named_parameters():
            assert p.requires_grad == flags[l][n], n
            if n in frozen[l]:
                assert torch.equal(p, frozen[l][n]), f"frozen {n} of layer {l} changed"
        for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "a_proj.weight",
                  "b_proj.weight", "g_proj.weight", "A_log", "dt_bias"):
            assert not torch.equal(m.get_parameter(n), trained[l][n]), f"{n} of layer {l} did not train"
    assert mixers[1].training and not mixers[2].training
    assert report["mean_rel_mse_after"] < report["mean_rel_mse_before"]


def test_train_o_proj_and_o_norm_switches(teacher_data):
    teacher, inputs, targets = teacher_data
    mixers = fresh_mixers(teacher)
    before = {n: p.detach().clone() for n, p in mixers[1].named_parameters()}
    align_layers(mixers, inputs, targets, AlignArgs(**SHORT, train_o_norm=True))
    assert not torch.equal(mixers[1].get_parameter("o_norm.weight"), before["o_norm.weight"])
    mixers = fresh_mixers(teacher)
    before = {n: p.detach().clone() for n, p in mixers[1].named_parameters()}
    align_layers(mixers, inputs, targets, AlignArgs(**SHORT, train_o_proj=False))
    assert torch.equal(mixers[1].get_parameter("o_proj.weight"), before["o_proj.weight"])
    assert not torch.equal(mixers[1].get_parameter("q_proj.weight"), before["q_proj.weight"])


def test_lr_scale_multiplies_every_rate(teacher_data):
    """--phase2.lr_scale 0.5 trains exactly as every rate (new, q/k/v, o_proj, dynamics) halved by hand."""
    teacher, inputs, targets = teacher_data
    rates = dict(lr=1e-2, lr_qkv=1e-3, lr_o=3e-3, lr_dynamics=3e-2)
    scaled, halved = fresh_mixers(teacher), fresh_mixers(teacher)
    align_layers(scaled, inputs, targets, AlignArgs(**{**SHORT, **rates, "lr_scale": 0.5}))
    align_layers(halved, inputs, targets, AlignArgs(**{**SHORT, **{k: v / 2 for k, v in rates.items()}}))
    full = fresh_mixers(teacher)
    align_layers(full, inputs, targets, AlignArgs(**{**SHORT, **rates}))
    for l in LAYERS:
        for (n, a), b in zip(scaled[l].named_parameters(), halved[l].parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=n)
        assert not torch.equal(scaled[l].q_proj.weight, full[l].q_proj.weight)
    with pytest.raises(ValueError, match="lr_scale"):
        AlignArgs(lr_scale=0.0)


def test_lr_scale_follows_the_size_of_the_teachers_attention_weights():
    """The factor is the RMS of q/k/v/o against TUNED_RMS: projections 20x as large give 20x the factor (to two
    digits); a set --phase2.lr_scale is kept."""
    teacher = tiny_teacher("llama")
    rms = torch.stack([getattr(layer.self_attn, n).weight.pow(2).mean().sqrt() for layer in teacher.model.layers
                       for n in ("q_proj", "k_proj", "v_proj", "o_proj")]).mean().item()
    assert teacher_lr_scale(teacher) == round(rms / TUNED_RMS, 2)
    with torch.no_grad():
        for layer in teacher.model.layers:
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, n).weight.mul_(20)
    assert teacher_lr_scale(teacher) == round(20 * rms / TUNED_RMS, 2)
    assert resolve_lr_scale(AlignArgs(), teacher).lr_scale == teacher_lr_scale(teacher)
    assert resolve_lr_scale(AlignArgs(lr_scale=0.3), teacher).lr_scale == 0.3


DYNAMICS = ("A_log", "dt_bias", "a_proj.weight", "b_proj.weight")


def test_lr_dynamics_freezes_or_separates_the_decay_and_write_gate(teacher_data):
    """lr_dynamics 0 keeps phase 1's decay and write gate through alignment while the rest trains; a separate value
    puts them in an optimizer group of their own."""
    teacher, inputs, targets = teacher_data
    mixers = fresh_mixers(teacher)
    before = {n: p.detach().clone() for n, p in mixers[1].named_parameters()}
    report = align_layers(mixers, inputs, targets, AlignArgs(**SHORT, lr_dynamics=0.0))
    for n in DYNAMICS:
        assert torch.equal(mixers[1].get_parameter(n), before[n]), n
    for n in ("q_proj.weight", "g_proj.weight", "o_proj.weight"):
        assert not torch.equal(mixers[1].get_parameter(n), before[n]), n
    full = align_layers(fresh_mixers(teacher), inputs, targets, AlignArgs(**SHORT))
    assert report["layers"][1]["trained_params"] == full["layers"][1]["trained_params"] - sum(
        before[n].numel() for n in DYNAMICS)
    moved = {}
    for lr in (1e-4, 1e-2):
        mixers = fresh_mixers(teacher)
        align_layers(mixers, inputs, targets, AlignArgs(**SHORT, lr_dynamics=lr))
        moved[lr] = (mixers[1].dt_bias - before["dt_bias"]).abs().max().item()
    assert 0 < moved[1e-4] < moved[1e-2]
    with pytest.raises(ValueError):
        AlignArgs(lr_dynamics=-1.0)


def test_nan_guard_restores_and_stops_the_layer(teacher_data, caplog):
    teacher, inputs, targets = teacher_data
    bad_row = N - 1  # not an evaluation row
    poisoned = dict(targets)
    poisoned[1] = targets[1].clone()
    poisoned[1][bad_row] = float("nan")
    args = AlignArgs(**{**FAST, "steps": 30, "log_every": 5})
    mixers = fresh_mixers(teacher)
    with caplog.at_level("WARNING", logger="taylor_calibrate"):
        report = align_layers(mixers, inputs, poisoned, args)

    rows = batch_indices(N, args.batch_size, args.steps, args.seed)
    first = 1 + next(s for s in range(args.steps) if bad_row in rows[s].tolist())  # steps are 1-based
    r1, r2 = report["layers"][1], report["layers"][2]
    assert r1["diverged_at"] == first
    assert "layer 1 diverged" in caplog.text and f"step {first}" in caplog.text
    assert all(torch.isfinite(p).all() for p in mixers[1].parameters())
    assert math.isfinite(r1["rel_mse_after"]) and r1["rel_mse_after"] <= r1["rel_mse_before"]
    assert r1["best_step"] < first
    assert math.isclose(r1["rel_mse_after"], rel_mse(mixers[1], inputs[1][:4], targets[1][:4]), rel_tol=1e-6)
    assert r2["diverged_at"] is None and r2["rel_mse_after"] < 0.9 * r2["rel_mse_before"]  # layers do not interact


def test_nan_guard_mid_run_keeps_the_best_state_so_far(teacher_data, monkeypatch):
    """Layer 2's targets turn NaN at its 13th training step: the state kept at step 10 stays, and the layer no longer
    changes (it stays in its stack but is put back after every step)."""
    from taylor_calibrate import align

    teacher, inputs, targets = teacher_data
    mixers = fresh_mixers(teacher)
    calls = {"n": 0}
    batch = align._LayerState.batch

    def poisoned(self, rows, crop, staging):
        x, y, w = batch(self, rows, crop, staging)
        if self.layer == 2:
            calls["n"] += 1
            if calls["n"] == 13:
                y = y * float("nan")
        return x, y, w

    monkeypatch.setattr(align._LayerState, "batch", poisoned)
    report = align_layers(mixers, inputs, targets, AlignArgs(**{**FAST, "steps": 30, "log_every": 5}))
    r2 = report["layers"][2]
    assert r2["diverged_at"] == 13 and r2["best_step"] == 10 and calls["n"] == 30
    assert all(torch.isfinite(p).all() for p in mixers[2].parameters())
    assert math.isclose(r2["rel_mse_after"], r2["best_eval_rel_mse"], rel_tol=1e-6)
    assert r2["rel_mse_after"] < r2["rel_mse_before"]
    r1 = report["layers"][1]
    assert r1["diverged_at"] is None and r1["best_step"] == 30  # the other layer trains on


def test_layer_never_finite_is_frozen_at_divergence(teacher_data):
    """A layer whose evaluation rel-MSE is undefined from the start (constant targets) has no best state: it is kept
    as it was when the guard stopped it at the first check (it stays in its stack; the optimizer must not move it
    afterwards), whatever the run length."""
    teacher, inputs, targets = teacher_data
    poisoned = dict(targets)
    poisoned[1] = targets[1].clone()
    poisoned[1][:4] = 0.0  # the evaluation rows: constant targets, so rel-MSE is undefined; training stays finite
    states = []
    for steps in (10, 30):
        mixers = fresh_mixers(teacher)
        report = align_layers(mixers, inputs, poisoned, AlignArgs(**{**FAST, "steps": steps, "log_every": 5}))
        assert report["layers"][1]["diverged_at"] == 5 and report["layers"][1]["best_step"] == 0
        assert report["layers"][2]["diverged_at"] is None
        states.append({n: p.detach().clone() for n, p in mixers[1].named_parameters()})
    for n, t in states[0].items():
        assert torch.isfinite(t).all(), n
        torch.testing.assert_close(states[1][n], t, rtol=0, atol=0, msg=n)


def test_same_seed_same_result(teacher_data):
    teacher, inputs, targets = teacher_data
    args = AlignArgs(**{**FAST, "steps": 20})
    runs = []
    for _ in range(2):
        mixers = fresh_mixers(teacher)
        report = align_layers(mixers, inputs, targets, args)
        runs.append((report, {l: {n: t.clone() for n, t in m.state_dict().items()} for l, m in mixers.items()}))
    (r0, s0), (r1, s1) = runs
    for l in LAYERS:
        assert r0["layers"][l]["rel_mse_after"] == r1["layers"][l]["rel_mse_after"]
        assert all(torch.equal(s0[l][n], s1[l][n]) for n in s0[l])


def test_stacked_layers_train_as_if_alone(teacher_data, monkeypatch):
    """All layers in one stacked recurrence (layer_group None) = one layer per forward (layer_group 1) = a layer
    aligned on its own: stacking saves kernel launches and changes nothing else."""
    from taylor_calibrate import ops

    teacher, inputs, targets = teacher_data
    calls = {"n": 0}
    impls = dict(ops.GDN_KERNELS)

    def counted(fn):
        def wrapper(*a, **k):
            calls["n"] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(ops, "GDN_KERNELS", {key: counted(fn) for key, fn in impls.items()})
    states, counts = {}, {}
    for group in (None, 1, "alone"):
        calls["n"] = 0
        mixers = fresh_mixers(teacher)
        args = AlignArgs(**{**FAST, "steps": 12, "log_every": 12, "layer_group": None if group == "alone" else group})
        if group == "alone":
            for l in LAYERS:
                align_layers({l: mixers[l]}, {l: inputs[l]}, {l: targets[l]}, args)
        else:
            align_layers(mixers, inputs, targets, args)
        states[group] = {l: {n: t.clone() for n, t in m.state_dict().items()} for l, m in mixers.items()}
        counts[group] = calls["n"]
    for other in (1, "alone"):
        for l in LAYERS:
            for n, t in states[None][l].items():
                torch.testing.assert_close(t, states[other][l][n], rtol=1e-5, atol=1e-6, msg=f"{other} {l} {n}")
    assert counts[1] - counts[None] == 12 * (len(LAYERS) - 1)  # one recurrence call per step instead of one per layer


# the defaults, the plain mean over positions at a constant rate, and position weights (--phase2.far_weight)
@pytest.mark.parametrize("sink_weight,schedule,weighted", [(64.0, "wsd", False), (1.0, "constant", False),
                                                           (64.0, "wsd", True)])
def test_stacked_step_is_the_plain_training_loop(teacher_data, sink_weight, schedule, weighted):
    """The vmapped stack (all layers' projections, convs and gates batched; parameters as slices of one tensor; clipping
    per layer) computes what a plain loop does for each layer alone: mixer forward, MSE with the first position
    weighted `sink_weight` (and each row's positions by their weights), clip_grad_norm_, AdamW under the schedule
    (the defaults: wsd, sink weight 64)."""
    from taylor_calibrate.align import trained_parameters

    teacher, inputs, targets = teacher_data
    args = AlignArgs(**{**FAST, "steps": 5, "log_every": 5, "grad_clip": 0.05,  # a small clip: it acts
                        "sink_weight": sink_weight, "schedule": schedule})
    gen = torch.Generator().manual_seed(1)
    weights = {l: torch.rand(x.shape[:2], generator=gen) * 3 for l, x in inputs.items()} if weighted else None
    stacked = fresh_mixers(teacher)
    report = align_layers(stacked, inputs, targets, args, weights=weights)
    plain = fresh_mixers(teacher)
    rows = batch_indices(N, args.batch_size, args.steps, args.seed)
    lrs = {"new": args.lr, "qkv": args.lr_qkv, "o_proj": args.lr_o, "dynamics": args.lr_dynamics}
    for l, m in plain.items():
        assert report["layers"][l]["best_step"] == 5  # the compared state is the last one
        groups = trained_parameters(m, args)
        params = [p for g in groups.values() for _, p in g]
        for p in m.parameters():
            p.requires_grad_(any(p is q for q in params))
        opt = torch.optim.AdamW([{"params": [p for _, p in g], "lr": lrs[k]} for k, g in groups.items()],
                                weight_decay=args.weight_decay)
        w = torch.ones(inputs[l].shape[1])
        w[0] = args.sink_weight
        for step, r in enumerate(rows, 1):
            for g, k in zip(opt.param_groups, groups):
                g["lr"] = lrs[k] * lr_factor(step, args)
            err = (m(inputs[l][r])[0] - targets[l][r]).pow(2).mean(2)  # per row and position
            err = (err * weights[l][r] if weighted else err).mean(0)  # per position
            loss = (err * w).sum() / w.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            opt.zero_grad()
        for n, p in m.named_parameters():
            torch.testing.assert_close(stacked[l].get_parameter(n), p, rtol=1e-4, atol=1e-6, msg=f"{l} {n}")


def test_stack_clips_each_layer_as_clip_grad_norm(teacher_data):
    """Per-layer clipping of the stacked gradients = torch's clip_grad_norm_ on each layer's own parameters (the
    optimizer test above cannot see it: Adam is nearly blind to a gradient's scale)."""
    from taylor_calibrate.align import _LayerState, _Stack

    teacher, inputs, targets = teacher_data
    mixers = fresh_mixers(teacher)
    states = [_LayerState(l, mixers[l], inputs[l], targets[l], 4, 2, AlignArgs(**FAST)) for l in LAYERS]
    stack = _Stack(states)
    g = torch.Generator().manual_seed(0)
    for t in stack.trained().values():
        t.grad = torch.randn(t.shape, generator=g) * torch.tensor([1.0, 30.0]).view(-1, *(1,) * (t.ndim - 1))
    want = []
    for i in range(len(LAYERS)):
        own = [t.grad[i].clone().requires_grad_() for t in stack.trained().values()]
        for o in own:
            o.grad = o.detach().clone()
        norm = torch.nn.utils.clip_grad_norm_(own, 5.0)
        want.append((norm, [o.grad for o in own]))
    norms = stack.clip_(5.0)
    for i, (norm, grads) in enumerate(want):
        torch.testing.assert_close(norms[i], norm)
        for t, w in zip(stack.trained().values(), grads):
            torch.testing.assert_close(t.grad[i], w)
    assert norms[1] > 10 * norms[0] > 50.0  # both clipped, each by its own factor
    stack.unstack()


def test_batch_order_is_seeded_permutations():
    rows = batch_indices(5, 2, 7, seed=3)  # 14 indices: two full epochs + 4 of the third
    assert rows.shape == (7, 2)
    flat = rows.flatten().tolist()
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))
    assert torch.equal(rows, batch_indices(5, 2, 7, seed=3)) and not torch.equal(rows, batch_indices(5, 2, 7, seed=4))


def test_seq_len_tokens_per_step(teacher_data):
    teacher, inputs, targets = teacher_data
    args = AlignArgs(steps=2, seq_len=8, batch_size=3, lr_qkv=1e-3)
    report = align_layers(fresh_mixers(teacher), inputs, targets, args)
    assert report["tokens_per_step"] == 3 * 8


def test_profile_fills_the_copied_projections_rate_and_align_needs_one(teacher_data):
    """The best lr_qkv depends on the budget (docs/decisions.md): each profile brings its own unless one is given."""
    from taylor_calibrate.config import ConvertArgs, apply_profile, load_profile

    for name, want in (("full", 3.6e-3), ("quick", 9e-4)):
        args = ConvertArgs(profile=name)
        apply_profile(args, "cpu")
        assert args.phase2.lr_qkv == load_profile(name)["phase2"]["lr_qkv"] == want
    args = ConvertArgs(profile="quick", phase2=AlignArgs(lr_qkv=5e-3))
    apply_profile(args, "cpu")
    assert args.phase2.lr_qkv == 5e-3
    teacher, inputs, targets = teacher_data
    with pytest.raises(ValueError, match="lr_qkv"):
        align_layers(fresh_mixers(teacher), inputs, targets, AlignArgs(steps=2, batch_size=2))
    with pytest.raises(ValueError, match="lr_qkv"):
        AlignArgs(lr_qkv=-1.0)


def test_lr_schedule():
    c = AlignArgs(steps=100, batch_size=4, schedule="constant")
    assert all(lr_factor(s, c) == 1.0 for s in (1, 50, 100))
    w = AlignArgs(steps=100, batch_size=4, schedule="wsd")
    assert all(lr_factor(s, w) == 1.0 for s in (1, 50, 80)) and lr_factor(90, w) == pytest.approx(0.51)
    assert lr_factor(100, w) == pytest.approx(0.01)
    w5 = AlignArgs(steps=100, batch_size=4, schedule="wsd", decay_fraction=0.5)
    assert lr_factor(50, w5) == 1.0 and lr_factor(75, w5) == pytest.approx(0.51)
    with pytest.raises(ValueError, match="decay_fraction"):
        AlignArgs(decay_fraction=0.0)
    with pytest.raises(ValueError, match="schedule"):
        AlignArgs(schedule="cosine")
    with pytest.raises(ValueError, match="sink_weight"):
        AlignArgs(sink_weight=-1.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the page-locked staging path needs CUDA"))])
def test_staging_delivers_exactly_the_indexed_rows(device):
    """Rows gathered through the rotating staging buffers equal plain indexing, also when buffers are reused while
    earlier copies may still be in flight (more calls than slots, two tensors of the same shape interleaved)."""
    from taylor_calibrate.align import _Staging

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 16, 8, generator=g).bfloat16(), torch.randn(12, 16, 8, generator=g).bfloat16()
    staging, dev = _Staging(), torch.device(device)
    got, want = [], []
    for step in range(3 * _Staging.SLOTS):
        rows = torch.randperm(12, generator=g)[:3]
        crop = slice(0, 10) if step % 2 else slice(None)
        for src in (x, y):
            got.append(staging(src, rows, crop, dev))
            want.append(src[rows, crop])
    for a, b in zip(got, want):
        assert a.device.type == device and a.dtype == b.dtype
        assert torch.equal(a.cpu(), b)


def test_realign_kept_fits_kept_attention_to_hybrid_inputs(arch):
    """--phase2.kept_attention: each kept attention module (a whole attention layer, a head-wise layer's kept heads)
    learns to give from the hybrid's inputs what it gave from the teacher's; the teacher and the GDN heads stay."""
    from taylor_calibrate.align import kept_attention, mixer_inputs, realign_kept

    teacher = tiny_teacher(arch)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    hybrid = convert_teacher(teacher, [0, 1, 2], GDNConfig(), kept_groups={1: [0], 2: [1]})  # layer 3 stays whole
    attns = kept_attention(hybrid)
    assert sorted(attns) == [1, 2, 3] and attns[3] is hybrid.model.layers[3].self_attn
    assert attns[1] is hybrid.model.layers[1].self_attn.attn
    gdn = {k: v.clone() for k, v in hybrid.model.layers[1].self_attn.gdn.state_dict().items()}
    rows = torch.randint(0, teacher.config.vocab_size, (N, T), generator=torch.Generator().manual_seed(0))
    x_t, x_h = mixer_inputs(teacher, rows, [3], 2)[3], mixer_inputs(hybrid, rows, [3], 2)[3]
    assert not torch.allclose(x_t, x_h)  # the GDN layers before it moved the kept layer's inputs
    report = realign_kept(hybrid, teacher, rows, AlignArgs(**FAST))
    assert sorted(report["layers"]) == [1, 2, 3]
    for l, r in report["layers"].items():
        assert r["rel_mse_after"] <= r["rel_mse_before"], l  # the best-state rule: never worse on the eval rows
    assert report["mean_rel_mse_after"] < 0.8 * report["mean_rel_mse_before"]
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())  # the teacher is untouched
    assert all(torch.equal(gdn[k], v) for k, v in hybrid.model.layers[1].self_attn.gdn.state_dict().items())


def test_roped_attention_is_the_layers_own_attention(arch):
    """align.roped: a kept attention module called on what its layer receives gives what it gives inside the model's
    forward (its rotary embedding per layer type, its sliding window: tiny mistral / gemma3 windows are shorter than
    the rows)."""
    from taylor_calibrate.align import mixer_inputs, roped

    teacher = tiny_teacher(arch)
    ids = torch.randint(0, teacher.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    layers = list(range(teacher.config.num_hidden_layers))
    inputs = mixer_inputs(teacher, ids, layers, 2)
    outs = {}
    hooks = [teacher.model.layers[i].self_attn.register_forward_hook(
        lambda mod, args, out, i=i: outs.__setitem__(i, out[0].detach())) for i in layers]
    with torch.no_grad():
        teacher(input_ids=ids, use_cache=False)
        for h in hooks:
            h.remove()
        for i in layers:
            got = roped(teacher, i, teacher.model.layers[i].self_attn)(inputs[i])[0]
            torch.testing.assert_close(got, outs[i], rtol=1e-4, atol=1e-5)


def test_mixer_inputs_stop_at_the_deepest_wanted_layer(teacher_data):
    """mixer_inputs gives what a full forward feeds each wanted mixer, and runs no layer after the deepest."""
    from taylor_calibrate.align import mixer_inputs

    teacher, inputs, _ = teacher_data
    ids = torch.randint(0, teacher.config.vocab_size, (N, T), generator=torch.Generator().manual_seed(0))
    after = []
    hook = teacher.model.layers[3].register_forward_pre_hook(lambda *_: after.append(1))
    try:
        got = mixer_inputs(teacher, ids, list(LAYERS), 4)
        assert not after
        teacher(input_ids=ids[:1], use_cache=False)  # the model runs whole again: no stop left behind
        assert after == [1]
    finally:
        hook.remove()
    for i in LAYERS:
        assert torch.allclose(got[i], inputs[i], atol=1e-6), i
