"""The gated delta rule (docs/method.md, "The GDN layer"): spec, chunked == recurrent, state carry, backends.

CPU tests run everywhere; the fla test runs only where fla and a CUDA GPU are present.
"""

import logging

import pytest
import torch
import torch.nn.functional as F

import taylor_calibrate.ops as ops
from taylor_calibrate.ops import fla as fla_ops
from taylor_calibrate.ops.reference import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule

B, H, K, V = 2, 3, 16, 24  # K != V so that a transposed state cannot pass


def make_inputs(T, *, B=B, H=H, K=K, V=V, dtype=torch.float64, device="cpu", seed=0, normalise=True):
    """Random GDN inputs: unit q, k; g = logsigmoid(randn) < 0; beta = sigmoid(randn); a random state."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if normalise:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    return dict(
        q=q, k=k, v=randn(B, T, H, V),
        g=F.logsigmoid(randn(B, T, H)), beta=randn(B, T, H).sigmoid(),
        initial_state=randn(B, H, K, V),
    )


def rel_rms(a, b):
    """rms(a - b) / rms(b), fla's test metric; the floor on rms(b) keeps an all-zero reference
    (dg at T=1 with no initial state) comparable."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-6)).item()


def run_with_grads(fn, inputs, dout, dstate, **kwargs):
    """Output, final state and the gradient of every input of <o, dout> + <S_T, dstate>."""
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items() if x is not None}
    o, S = fn(**leaves, output_final_state=True, **kwargs)
    loss = (o.to(dout.dtype) * dout).sum() + (S.to(dstate.dtype) * dstate).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o, S, dict(zip(leaves, grads))


# --- the spec itself ------------------------------------------------------------------------------


def test_hand_computed_two_steps():
    """T=2, H=1, K=V=2, worked by hand and in docs/method.md's (V x K) matrix form."""
    q = torch.tensor([[0.6, 0.8], [1.0, 0.0]])
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    v = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    gamma, beta = torch.tensor([0.5, 0.8]), torch.tensor([0.5, 0.25])
    scale = 2**-0.5

    # By hand (state K x V): S1 = 0.5 k1 v1^T = [[0.5, 1], [0, 0]];  o1 = scale * S1^T q1 = scale * [0.3, 0.6].
    # S = 0.8 S1 = [[0.4, 0.8], [0, 0]];  v2 - S^T k2 = [3 - 0.24, -1 - 0.48] = [2.76, -1.48];
    # S2 = S + 0.25 k2 [2.76, -1.48] = [[0.814, 0.578], [0.552, -0.296]];
    # o2 = scale * S2^T q2 = scale * [0.814, 0.578].
    o_hand = scale * torch.tensor([[0.3, 0.6], [0.814, 0.578]])
    S_hand = torch.tensor([[0.814, 0.578], [0.552, -0.296]])

    # docs/method.md, "The GDN layer", literally (state V x K):
    #   S_t = gamma_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,  o_t = S_t q_t / sqrt(d)
    S, o_formula = torch.zeros(2, 2), []
    for t in range(2):
        S = gamma[t] * S @ (torch.eye(2) - beta[t] * torch.outer(k[t], k[t])) + beta[t] * torch.outer(v[t], k[t])
        o_formula.append(S @ q[t] / 2**0.5)
    torch.testing.assert_close(torch.stack(o_formula), o_hand)
    torch.testing.assert_close(S.T, S_hand)  # docs/method.md's V x K state is the transpose of ours

    args = [x[None, :, None] for x in (q, k, v, gamma.log(), beta)]  # B = H = 1
    for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        o, S_T = fn(*args, output_final_state=True)
        torch.testing.assert_close(o[0, :, 0], o_hand)
        torch.testing.assert_close(S_T[0, 0], S_hand)


# --- chunked == recurrent, forward and backward ---------------------------------------------------


@pytest.mark.parametrize("T", [1, 3, 63, 64, 65, 300])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_recurrent(T, chunk_size, with_state):
    inputs = make_inputs(T, seed=T)
    if not with_state:
        inputs["initial_state"] = None
    dout, dstate = torch.randn(B, T, H, V, dtype=torch.float64), torch.randn(B, H, K, V, dtype=torch.float64)
    o_ref, S_ref, g_ref = run_with_grads(recurrent_gated_delta_rule, inputs, dout, dstate)
    o, S, grads = run_with_grads(chunk_gated_delta_rule, inputs, dout, dstate, chunk_size=chunk_size)
    assert rel_rms(o, o_ref) < 1e-8 and rel_rms(S, S_ref) < 1e-8
    assert grads.keys() == g_ref.keys()
    for name in g_ref:
        assert rel_rms(grads[name], g_ref[name]) < 1e-8, name


def test_chunk_matches_recurrent_fp32():
    """The fp32 path (what CPU training runs) against the fp64 ground truth, fla-style tolerance."""
    inputs = make_inputs(200, seed=1)
    dout, dstate = torch.randn(B, 200, H, V, dtype=torch.float64), torch.randn(B, H, K, V, dtype=torch.float64)
    o_ref, S_ref, g_ref = run_with_grads(recurrent_gated_delta_rule, inputs, dout, dstate)
    inputs32 = {n: x.float() for n, x in inputs.items()}
    o, S, grads = run_with_grads(chunk_gated_delta_rule, inputs32, dout.float(), dstate.float())
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert rel_rms(o, o_ref) < 1e-3 and rel_rms(S, S_ref) < 1e-3
    for name in g_ref:
        assert rel_rms(grads[name], g_ref[name]) < 1e-3, name


def test_low_precision_inputs_computed_in_fp32():
    """bf16 in -> bf16 out, fp32 state; the arithmetic inside is fp32 for both forms."""
    inputs = {n: x.bfloat16() for n, x in make_inputs(40).items()}
    o_rec, S_rec = recurrent_gated_delta_rule(**inputs, output_final_state=True)
    o_chk, S_chk = chunk_gated_delta_rule(**inputs, output_final_state=True, chunk_size=16)
    assert o_rec.dtype == o_chk.dtype == torch.bfloat16 and S_rec.dtype == S_chk.dtype == torch.float32
    assert rel_rms(S_chk, S_rec) < 1e-5


# --- decoding relies on these ---------------------------------------------------------------------


@pytest.mark.parametrize("split", [1, 37, 64])
def test_state_carry_equals_one_pass(split):
    """Prefill the first `split` tokens, then decode the rest token by token carrying the state."""
    T = 80
    inputs = make_inputs(T, seed=2)
    h0 = inputs.pop("initial_state")
    o_full, S_full = ops.gated_delta_rule(**inputs, initial_state=h0, output_final_state=True, mode="chunk")

    first = {n: x[:, :split] for n, x in inputs.items()}
    o_parts, S = [], h0
    o, S = ops.gated_delta_rule(**first, initial_state=S, output_final_state=True)
    o_parts.append(o)
    for t in range(split, T):
        step = {n: x[:, t : t + 1] for n, x in inputs.items()}
        o, S = ops.gated_delta_rule(**step, initial_state=S, output_final_state=True)  # mode auto -> recurrent
        o_parts.append(o)
    assert rel_rms(torch.cat(o_parts, dim=1), o_full) < 1e-8
    assert rel_rms(S, S_full) < 1e-8


@pytest.mark.parametrize("fn", [recurrent_gated_delta_rule, chunk_gated_delta_rule])
def test_use_qk_l2norm_equals_normalising_first(fn):
    inputs = make_inputs(50, seed=3, normalise=False)
    o_flag, S_flag = fn(**inputs, use_qk_l2norm=True, output_final_state=True)
    inputs["q"], inputs["k"] = l2norm(inputs["q"]), l2norm(inputs["k"])
    o, S = fn(**inputs, output_final_state=True)
    assert rel_rms(o_flag, o) < 1e-12 and rel_rms(S_flag, S) < 1e-12


def test_dispatcher_modes_agree():
    inputs = make_inputs(20, seed=4)
    o_c, S_c = ops.gated_delta_rule(**inputs, output_final_state=True, mode="chunk")
    o_r, S_r = ops.gated_delta_rule(**inputs, output_final_state=True, mode="recurrent")
    assert rel_rms(o_c, o_r) < 1e-8 and rel_rms(S_c, S_r) < 1e-8
    with pytest.raises(ValueError, match="chunk"):
        ops.gated_delta_rule(**inputs, mode="parallel")


# --- backend resolution ---------------------------------------------------------------------------


def test_auto_backend_resolves_once_and_logs(monkeypatch, caplog):
    monkeypatch.setattr(ops, "_resolved", {})
    with caplog.at_level(logging.INFO, logger="taylor_calibrate"):
        first, second = ops.resolve_backend("auto"), ops.resolve_backend("auto")
    assert first == second == ("fla" if fla_ops.fla_available() else "torch")
    assert [r.getMessage() for r in caplog.records if "GDN backend" in r.getMessage()] == [
        f"GDN backend: auto -> {first}" + ("" if first == "fla" else f" ({fla_ops.fla_unavailable_reason()})")
    ]
    assert ops.resolve_backend("torch") == "torch"


@pytest.mark.skipif(fla_ops.fla_available(), reason="fla and CUDA are present here")
def test_fla_backend_fails_loudly_without_fla():
    with pytest.raises(RuntimeError, match=r"pip install flash-linear-attention fla-core.*--backend torch"):
        ops.resolve_backend("fla")
    inputs = make_inputs(4, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="unavailable"):
        ops.gated_delta_rule(**inputs, backend="fla")
    with pytest.raises(ValueError, match="CUDA GPU.*--backend torch"):  # the kernels' own guard, before any import
        fla_ops.chunk_gated_delta_rule(**inputs)
    assert "--backend torch" in fla_ops.check_fla_backward()


class _Refuses(torch.autograd.Function):
    """Identity forward, a backward that raises as fla's does on Hopper with Triton < 3.7.1 and no tilelang."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")


def _refusing_kernel(calls):
    def kernel(q, k, v, g, beta, **kw):
        calls.append(q.shape)
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        return _Refuses.apply(o), ht
    return kernel


def _grads(fn, inputs):
    leaves = {n: x.clone().requires_grad_(True) for n, x in inputs.items()}
    o, ht = fn(**leaves, output_final_state=True)
    (o.square().sum() + ht.sum()).backward()
    return o.detach(), {n: x.grad for n, x in leaves.items()}


@pytest.mark.parametrize("refuses", [False, True])
def test_first_backward_checks_fla_on_the_real_step(monkeypatch, caplog, refuses):
    """Backend auto runs no separate fla check: the first training step's backward tries fla's and, where it refuses
    (fla #640), differentiates the reference instead, says so once, and later steps train on the reference."""
    calls = []
    kernel = _refusing_kernel(calls) if refuses else chunk_gated_delta_rule
    monkeypatch.setattr(fla_ops, "chunk_gated_delta_rule", kernel)  # stands in for fla's (CUDA-only) kernel
    monkeypatch.setitem(ops.GDN_KERNELS, ("fla", "chunk"), kernel)
    monkeypatch.setitem(ops._resolved, "fla", "fla")
    monkeypatch.setattr(ops, "_FLA_BACKWARD", {})
    monkeypatch.setattr(ops, "_fla_backward_refused", False)
    inputs = make_inputs(20)
    want_o, want = _grads(chunk_gated_delta_rule, inputs)
    with caplog.at_level(logging.WARNING, logger="taylor_calibrate"):
        for step in range(3):
            o, got = _grads(lambda **kw: ops.gated_delta_rule(**kw, backend="fla"), inputs)
            torch.testing.assert_close(o, want_o)
            for name in want:
                torch.testing.assert_close(got[name], want[name], msg=name)
    problem = ops._FLA_BACKWARD["problem"]
    if refuses:
        assert "incorrect results" in problem and "Triton" in problem
        assert len(calls) == 2  # step 0: the forward and the recomputed one; step 1 never reaches the fla kernel
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "torch path" in caplog.records[0].message and "tilelang" in caplog.records[0].message
    else:
        assert problem is None and not caplog.records
    with torch.no_grad():  # inference never goes through the check
        ops.gated_delta_rule(**inputs, backend="fla")


@pytest.mark.parametrize("refuses", [False, True])
def test_first_backward_does_not_recompile_a_compiled_caller(monkeypatch, refuses):
    """A compiled layer that trains through fla is traced once: the first step's check of fla's backward changes
    nothing its graph depends on (a recompile at step 2 costs a fresh trace of every compiled layer). Where fla
    refuses, one recompile puts the reference inside the graph, and gradients stay the reference's."""
    calls = []
    kernel = torch.compiler.disable(_refusing_kernel(calls) if refuses else chunk_gated_delta_rule)  # as fla's is
    monkeypatch.setattr(fla_ops, "chunk_gated_delta_rule", kernel)
    monkeypatch.setitem(ops.GDN_KERNELS, ("fla", "chunk"), kernel)
    monkeypatch.setitem(ops._resolved, "fla", "fla")
    monkeypatch.setattr(ops, "_FLA_BACKWARD", {})
    monkeypatch.setattr(ops, "_fla_backward_refused", False)
    inputs = make_inputs(20)
    want_o, want = _grads(chunk_gated_delta_rule, inputs)
    graphs = []

    def backend(gm, example_inputs):  # counts what dynamo hands over, runs it as traced
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    def layer(q, **kw):  # a compiled layer: its own ops around the rule
        o, ht = ops.gated_delta_rule(q * 1.0, **kw, backend="fla")
        return o * 1.0, ht

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=backend)
    with torch._dynamo.config.patch(error_on_recompile=not refuses):
        for step in range(4):
            o, got = _grads(compiled, inputs)
            torch.testing.assert_close(o, want_o)
            for name in want:
                torch.testing.assert_close(got[name], want[name], msg=name)
            if step == 0:
                first = len(graphs)
    torch._dynamo.reset()
    assert len(calls) == (2 if refuses else 0)
    assert first >= 1
    if refuses:  # the reference joined the layer's graph: one more, larger graph, and none after it
        assert len(graphs) > first and graphs[-1] > max(graphs[:first])
    else:
        assert len(graphs) == first


def test_unknown_backend():
    with pytest.raises(ValueError, match="auto, torch, fla"):
        ops.resolve_backend("bogus")


# --- the fla kernels against the reference (GPU only) ---------------------------------------------


@pytest.mark.skipif(not fla_ops.fla_available(), reason="needs flash-linear-attention and a CUDA GPU")
@pytest.mark.parametrize("T", [3, 63, 300])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_fla_matches_reference(T, mode):
    """flash-attention's rule: kernel error vs an fp32 reference <= 2x a bf16 PyTorch run's error (+ eps).

    Gradients only for the chunk kernel: fla's fused recurrent kernel has no backward.
    """
    GK, GV = 64, 128
    x = make_inputs(T, K=GK, V=GV, dtype=torch.float32, device="cuda", seed=T)
    low = {n: t.bfloat16() for n, t in x.items() if n in ("q", "k", "v", "beta")}  # what a bf16 model passes
    inputs = dict(x, **low)  # g and initial_state stay fp32
    fp32 = {n: t.float() for n, t in inputs.items()}  # the same numbers, upcast
    dout = torch.randn(B, T, H, GV, device="cuda")
    dstate = torch.randn(B, H, GK, GV, device="cuda")
    kernel = fla_ops.chunk_gated_delta_rule if mode == "chunk" else fla_ops.recurrent_gated_delta_rule

    check_grads = mode == "chunk"
    if check_grads and (why := fla_ops.check_fla_backward()) is not None:
        check_grads = False
        reason = f"fla backward unavailable: {why}"

    def run(fn, args, **kw):
        if check_grads:
            return run_with_grads(fn, args, dout, dstate, **kw)
        with torch.no_grad():
            o, S = fn(**args, output_final_state=True, **kw)
        return o, S, {}

    o_ref, S_ref, g_ref = run(recurrent_gated_delta_rule, fp32)
    o_pt, S_pt, g_pt = run(recurrent_gated_delta_rule, inputs, compute_dtype=torch.bfloat16)
    o_fla, S_fla, g_fla = run(kernel, inputs)
    assert o_fla.dtype == torch.bfloat16 and S_fla.dtype == torch.float32

    def err(a, b):
        return (a.float() - b.float()).abs().max().item()

    for name, ours, pt, ref in [("o", o_fla, o_pt, o_ref), ("final_state", S_fla, S_pt, S_ref)] + [
        (f"d{n}", g_fla[n], g_pt[n], g_ref[n]) for n in g_ref
    ]:
        msg = f"{name}: fla {err(ours, ref):.3g} vs bf16 torch {err(pt, ref):.3g}"
        assert err(ours, ref) <= 2 * err(pt, ref) + 1e-5, msg
    if mode == "chunk" and not check_grads:
        pytest.skip(reason)


def test_tuned_fla_configs_are_used_for_their_gpu_and_fla_version_only(monkeypatch):
    """The shipped configs are pointed to (strict matching) for the GPU and fla version they were tuned on; a user's
    own FLA_CACHE_MODE / FLA_CONFIG_DIR, another GPU or another fla version leave fla's autotuning alone."""
    import importlib.metadata
    import os
    import sys

    monkeypatch.delitem(sys.modules, "fla.ops.utils.cache", raising=False)
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    folder = fla_ops.use_tuned_configs()
    assert folder == fla_ops.TUNED_CONFIGS / "fla-0.6.0" / "NVIDIA_H200"
    assert os.environ["FLA_CONFIG_DIR"] == str(folder) and os.environ["FLA_CACHE_MODE"] == "strict"

    monkeypatch.setenv("FLA_CONFIG_DIR", "/mine")
    monkeypatch.setenv("FLA_CACHE_MODE", "fuzzy")
    assert fla_ops.use_tuned_configs() is None and os.environ["FLA_CONFIG_DIR"] == "/mine"
    monkeypatch.delenv("FLA_CACHE_MODE")
    monkeypatch.delenv("FLA_CONFIG_DIR")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    assert fla_ops.use_tuned_configs() is None and "FLA_CONFIG_DIR" not in os.environ
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.7.0")
    assert fla_ops.use_tuned_configs() is None and "FLA_CONFIG_DIR" not in os.environ


def test_shipped_fla_configs_are_in_flas_format():
    """Every shipped entry is keyed as fla looks it up (md5 of the sorted, compact JSON of its autotune key) and holds
    a Triton config; with fla installed, fla's own parser finds each entry by its key."""
    import hashlib
    import importlib.util
    import json

    files = sorted(fla_ops.TUNED_CONFIGS.glob("fla-*/*/*.json"))
    assert files
    for path in files:
        data = json.loads(path.read_text())
        assert data["kernel_name"] == path.stem and data["autotune_entries"]
        for digest, entry in data["autotune_entries"].items():
            key = json.dumps(entry["autotune_key"], separators=(",", ":"), sort_keys=True)
            assert hashlib.md5(key.encode()).hexdigest() == digest
            config = entry["config"]
            assert isinstance(config["kwargs"], dict) and config["num_warps"] > 0 and config["num_stages"] > 0
        if importlib.util.find_spec("fla") is not None:
            from fla.ops.utils.cache import AutotuneKey, KernelConfigFile

            parsed = KernelConfigFile.from_dict(path, data)
            for entry in data["autotune_entries"].values():
                assert parsed.lookup_exact(AutotuneKey(tuple(entry["autotune_key"])))["config"] == entry["config"]
