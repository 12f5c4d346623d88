"""The Triton distillation-loss kernel (ops/kd_triton.py) against its reference `kd_chunk` (ops/kd_torch.py): the KL
sum, the NLL sum and the gradient w.r.t. the student's logits, for every combination of the loss's terms (KL, NLL,
per-row weights, temperature, soft-caps), fp32 and bf16 logits, rows shorter and longer than one block. On a CPU the
kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET=1); on a CUDA machine the compiled kernel."""
import importlib.util
import os

import pytest
import torch

from conftest import triton_interpreter_shims

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton); the reference is tested in test_distill_loss.py",
                allow_module_level=True)
CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA and TRITON_INTERPRET is not 1", allow_module_level=True)

from taylor_calibrate import ops  # noqa: E402
from taylor_calibrate.ops.kd_torch import kd_chunk  # noqa: E402
from taylor_calibrate.ops.kd_triton import kd_chunk_triton  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # numpy, in the interpreter
if not CUDA:
    triton_interpreter_shims()


def _inputs(n, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(n, V, generator=g) * 3).to(dtype)
    t = (torch.randn(n, V, generator=g) * 3).to(dtype)
    y = torch.randint(0, V, (n,), generator=g)
    y[1] = -100  # a row with no next token
    w = torch.rand(n, generator=g) + 0.5
    return [x.to(DEVICE) for x in (s, t, y, w)]


CASES = [  # (teacher, labels, weights, tau, s_cap, t_cap)
    (True, False, False, 1.0, None, None),  # the default: forward KL only
    (True, True, True, 1.0, None, None),
    (True, True, False, 2.0, None, None),  # temperature: the NLL takes its own softmax
    (True, False, True, 1.0, 30.0, 30.0),  # Gemma's final-logit soft-cap on both
    (False, True, False, 1.0, None, None),  # NLL only
    (False, True, False, 0.5, 5.0, None),
    (True, True, True, 1.5, 5.0, 7.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [300, 5000])  # one block; two blocks, the second partial
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, V, dtype):
    has_t, has_y, has_w, tau, s_cap, t_cap = case
    s, t, y, w = _inputs(4, V, dtype)
    args = (s, t if has_t else None, y if has_y else None, w if has_w else None, tau, 0.37,
            torch.tensor(0.21, device=DEVICE), s_cap, t_cap)
    want = kd_chunk(*args)
    got = kd_chunk_triton(*args)
    for name, a, b in zip(("kl", "nll", "grad"), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            # sums in fp32 either way; a bf16 gradient within one bf16 step (Triton's interpreter truncates to bf16)
            rtol = 1e-5 if name != "grad" or dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=1e-6 * b.float().abs().max().item(),
                                       msg=name)


def test_no_gradient_asked():
    s, t, y, w = _inputs(3, 700, torch.float32)
    kl, nll, g = kd_chunk_triton(s, t, y, None, 1.0, 1.0, 0.5, grad=False)
    want = kd_chunk(s, t, y, None, 1.0, 1.0, 0.5, grad=False)
    assert g is None and want[2] is None
    torch.testing.assert_close(kl, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nll, want[1], rtol=1e-5, atol=1e-5)


def test_bad_rows_are_refused():
    s, t, _, _ = _inputs(4, 64, torch.float32)
    with pytest.raises(ValueError, match="contiguous rows"):
        kd_chunk_triton(s.t(), t.t(), None, None, 1.0, 1.0, 0.0)


def test_dispatcher(monkeypatch):
    """auto: the kernel for CUDA tensors, the reference for CPU tensors; a named 'triton' on CPU tensors fails loudly
    outside the interpreter; unknown names are refused."""
    monkeypatch.setattr(ops, "_loss_resolved", {})
    assert ops.loss_kernel("auto", "cpu", False) is kd_chunk
    assert ops.loss_kernel("torch", DEVICE, False) is kd_chunk
    assert ops.loss_kernel("triton", DEVICE, False) is kd_chunk_triton  # CUDA, or CPU under the interpreter
    with pytest.raises(ValueError, match="unknown"):
        ops.resolve_loss_backend("cuda", "cpu")
    if CUDA:
        assert ops.loss_kernel("auto", "cuda", False) is kd_chunk_triton
    monkeypatch.setattr(ops, "_loss_resolved", {})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="unavailable"):
        ops.resolve_loss_backend("triton", "cpu")
