"""The fused distillation loss (`distill.fused_kd`: both lm heads, the KL and the cross-entropy one chunk of tokens at a
time) against the full-logits reference (`distill.forward_kl`, cross-entropy on full logits): the same loss and
gradients in fp32, on bare tensors and on tiny models (tied and untied heads, Gemma's logit soft-cap, a frozen head),
the same held-out evaluation and the same training curve."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import one_thread, tiny_teacher

from taylor_calibrate.config import GDNConfig, TrainArgs
from taylor_calibrate.distill import (Dist, Head, check_head, distill, forward_kl, fused_kd, heldout_eval, kd_loss,
                                      model_hidden, output_head)
from taylor_calibrate.model.hybrid import convert_teacher

TOL = dict(rtol=1e-4, atol=1e-4)


def _capped(z, cap):
    return torch.tanh(z / cap) * cap if cap else z


def _reference(s_h, s_w, t_h, t_w, ids, tau, kl_weight, ce_weight, weights, cap):
    """The loss on full fp32 logits: kl_weight x forward_kl + ce_weight x cross-entropy of the next token."""
    s, t = _capped(s_h @ s_w.t(), cap), _capped(t_h @ t_w.t(), cap)
    loss = kl_weight * forward_kl(s, t, tau, weights)
    if ce_weight:
        loss = loss + ce_weight * F.cross_entropy(s[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return loss


@pytest.mark.parametrize("tau", [1.0, 2.5])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ce_weight", [0.0, 0.7])
@pytest.mark.parametrize("cap", [None, 3.0])
def test_fused_kd_equals_the_full_logits_loss(tau, weighted, ce_weight, cap):
    """Value and gradients (hidden states, head weight: trainable, tied to an embedding, frozen) within 1e-4, with a
    ragged last chunk (14 tokens in chunks of 4) and a non-unit upstream gradient."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 7, 16, 53
    ids = torch.randint(0, V, (B, T), generator=g)
    emb0, t_h, t_w = torch.randn(V, H, generator=g), torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    mix = torch.randn(H, H, generator=g) / 4
    w = 2 * torch.rand(B, T, generator=g) if weighted else None
    labels = F.pad(ids[:, 1:], (0, 1), value=-100) if ce_weight else None
    for head in ("untied", "tied", "frozen"):
        grads, values = {}, {}
        for path in ("reference", "fused"):
            emb = emb0.clone().requires_grad_(True)
            s_w = emb if head == "tied" else emb0.clone().requires_grad_(head == "untied")
            s_h = torch.tanh(emb[ids] @ mix)  # the hidden states depend on the embedding: a tied head's two paths
            if path == "reference":
                loss = _reference(s_h, s_w, t_h, t_w, ids, tau, 1.3, ce_weight, w, cap)
            else:
                loss, kl, nll = fused_kd(s_h, Head(s_w, cap), t_h, Head(t_w, cap), tau=tau, kl_weight=1.3,
                                         ce_weight=ce_weight, labels=labels, weights=w, chunk=4)
                assert not kl.requires_grad and not nll.requires_grad
                assert (nll.item() > 0) == bool(ce_weight)
            wanted = [emb] + ([s_w] if head == "untied" else [])
            values[path] = loss.item()
            grads[path] = torch.autograd.grad(3 * loss, wanted)
        assert values["reference"] > 0.1
        assert values["fused"] == pytest.approx(values["reference"], rel=1e-4, abs=1e-4)
        for a, b in zip(grads["fused"], grads["reference"]):
            torch.testing.assert_close(a, b, **TOL)


def test_fused_kd_parts_and_no_teacher():
    """The returned sums are the reference's parts; t_hidden None gives the cross-entropy alone; under no_grad no
    gradient buffer is formed and the value is the same."""
    g = torch.Generator().manual_seed(1)
    s_h, t_h = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    s_w, t_w = torch.randn(31, 8, generator=g), torch.randn(31, 8, generator=g)
    ids = torch.randint(0, 31, (2, 5), generator=g)
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    loss, kl, nll = fused_kd(s_h, Head(s_w), t_h, Head(t_w), tau=2.0, labels=labels, chunk=3)
    s, t = s_h @ s_w.t(), t_h @ t_w.t()
    assert kl.item() * 4 / 10 == pytest.approx(forward_kl(s, t, 2.0).item(), rel=1e-5)
    assert nll.item() / 8 == pytest.approx(F.cross_entropy(s[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).item(),
                                           rel=1e-5)
    ce_only, kl0, _ = fused_kd(s_h, Head(s_w), None, None, kl_weight=0.0, ce_weight=1.0, labels=labels, chunk=3)
    assert kl0.item() == 0 and ce_only.item() == pytest.approx(nll.item() / 8, rel=1e-6)
    with torch.no_grad():
        again, _, _ = fused_kd(s_h.requires_grad_(True), Head(s_w), t_h, Head(t_w), tau=2.0, labels=labels, chunk=3)
    assert again.item() == pytest.approx(loss.item(), rel=1e-6) and again.grad_fn is None


def _pair(arch, tied, cap=None):
    over = {"tie_word_embeddings": tied}
    if cap:
        over["final_logit_softcapping"] = cap
    teacher = tiny_teacher(arch, **over)
    student = convert_teacher(teacher, [1, 3], GDNConfig())
    with torch.no_grad():  # the student's head and last norm differ from the teacher's, so the KL is not ~0
        for p in student.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return student.train(), teacher


@pytest.mark.parametrize("arch, tied, cap, frozen_head, weights", [
    ("llama", False, None, False, (1.0, 0.5, 0.3)), ("llama", True, None, False, (1.0, 0.5, 0.3)),
    ("llama", False, None, True, (1.0, 0.5, 0.3)),
    ("gemma3_text", True, 0.5, False, (1.0, 0.5, 0.3)),  # a cap small enough to bend these tiny logits
    ("llama", True, None, False, (0.0, 0.5, 0.0)), ("llama", False, None, False, (0.0, 0.0, 1.0)),
])
def test_kd_loss_fused_follows_the_full_logits_on_models(single_thread, arch, tied, cap, frozen_head, weights):
    """kd_loss on a tiny hybrid and its teacher, fused (final hidden states + heads) against the models' full logits:
    the same loss parts and the same gradient on every trained parameter, with temperature and per-token weights,
    and every mix of the KL, cross-entropy and hidden-state terms (`weights`)."""
    student, teacher = _pair(arch, tied, cap)
    assert output_head(student).cap == cap and output_head(teacher).cap == cap
    if frozen_head:
        student.lm_head.weight.requires_grad_(False)
    ids = torch.randint(0, teacher.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    w = 1 + torch.rand(2, 12, generator=torch.Generator().manual_seed(1))
    kl_weight, ce_weight, hidden_weight = weights
    args = TrainArgs(temperature=2.0, kl_weight=kl_weight, ce_weight=ce_weight, hidden_weight=hidden_weight,
                     kl_chunk=5)
    runs = {}
    for head in ("logits", "fused"):
        student.zero_grad(set_to_none=True)
        with torch.no_grad():
            t_out = (model_hidden(teacher, ids, True) if head == "fused"
                     else teacher(input_ids=ids, use_cache=False, output_hidden_states=True))
        s_out = (model_hidden(student, ids, True) if head == "fused"
                 else student(input_ids=ids, use_cache=False, output_hidden_states=True))
        heads = (output_head(student), output_head(teacher)) if head == "fused" else None
        loss, parts = kd_loss(s_out, t_out, ids, args, w, heads)
        loss.backward()
        runs[head] = ({k: float(v) for k, v in parts.items()},
                      {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None})
    (parts_l, grads_l), (parts_f, grads_f) = runs["logits"], runs["fused"]
    named = {"kl": kl_weight, "ce": ce_weight, "hidden_mse": hidden_weight}
    assert parts_l.keys() == parts_f.keys() == {"loss"} | {k for k, v in named.items() if v}
    for k in parts_l:
        assert parts_f[k] == pytest.approx(parts_l[k], rel=1e-4, abs=1e-5), k
    assert grads_f.keys() == grads_l.keys()
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert (head_name in grads_f) == (not frozen_head and (tied or kl_weight + ce_weight > 0))
    for n in grads_l:
        torch.testing.assert_close(grads_f[n], grads_l[n], **TOL, msg=n)



@pytest.mark.parametrize("arch, tied, cap", [("llama", False, None), ("gemma3_text", True, 0.5)])
def test_both_paths_round_alike_under_bf16_autocast(single_thread, arch, tied, cap):
    """Under bf16 autocast (training's mixed precision; on the CPU here) with a bf16 teacher, the fused path's heads
    run in bf16 as the model's own lm_head does: its gradient is as far from the full-logits path's as bf16 rounding
    puts either from the fp32 gradient, or nearer. So a gap between the two paths' loss curves on a GPU comes from the
    run-to-run noise of the kernels, which training amplifies, not from the loss."""
    student, teacher32 = _pair(arch, tied, cap)
    ids = torch.randint(0, teacher32.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    runs = {}
    for head, bf16 in (("logits", False), ("logits", True), ("fused", True)):
        teacher = teacher32.to(torch.bfloat16) if bf16 else teacher32
        student.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            with torch.no_grad():
                t_out = model_hidden(teacher, ids) if head == "fused" else teacher(input_ids=ids, use_cache=False)
            s_out = model_hidden(student, ids) if head == "fused" else student(input_ids=ids, use_cache=False)
            heads = (output_head(student), output_head(teacher)) if head == "fused" else None
            loss, _ = kd_loss(s_out, t_out, ids, TrainArgs(kl_chunk=5), None, heads)
        loss.backward()
        runs[head, bf16] = (loss.item(), torch.cat([p.grad.flatten() for p in student.parameters()
                                                    if p.grad is not None]))
        teacher32 = teacher.float()
    (loss32, g32), (loss_l, g_l), (loss_f, g_f) = runs["logits", False], runs["logits", True], runs["fused", True]
    assert loss_l > 0.01 and loss_f == pytest.approx(loss_l, rel=1e-3)
    rounding = (g_l - g32).norm()
    assert 0 < rounding < 0.1 * g32.norm()  # bf16 did round, and only a little
    assert (g_f - g_l).norm() <= rounding, ((g_f - g_l).norm(), rounding)

def test_a_head_that_does_more_than_the_fused_loss_is_refused(single_thread):
    """A model scaling its logits (or with a biased lm_head) is refused with the fix, not distilled wrongly."""
    student, _ = _pair("llama", False)
    ids = torch.randint(0, 97, (1, 8))
    check_head(student, ids, "student")  # the model as it is passes

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = Scaled(64, 97, bias=False)
    scaled.weight = student.lm_head.weight
    student.lm_head = scaled
    with pytest.raises(ValueError, match="student's logits are not lm_head.*--train.head logits"):
        check_head(student, ids, "student")
    student.lm_head = torch.nn.Linear(64, 97, bias=True)
    with pytest.raises(ValueError, match="bias-free.*--train.head logits"):
        output_head(student)


def test_heldout_eval_is_the_full_logits_one(single_thread):
    """heldout_eval (fused heads, no full logits) gives the held-out NLL and KL of the models' full logits."""
    student, teacher = _pair("llama", False)
    rows = torch.randint(0, 97, (3, 10), generator=torch.Generator().manual_seed(0))
    got = heldout_eval(student, teacher, rows, 2, Dist(), torch.device("cpu"), chunk=7)
    with torch.no_grad():
        s, t = student(input_ids=rows).logits[:, :-1], teacher(input_ids=rows).logits[:, :-1]
        nll = F.cross_entropy(s.flatten(0, 1), rows[:, 1:].flatten()).item()
        kl = forward_kl(s, t, 1.0).item()
    assert got["heldout_loss"] == pytest.approx(nll, rel=1e-5)
    assert got["heldout_kl"] == pytest.approx(kl, rel=1e-4) and kl > 1e-3
    assert got["heldout_ppl"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_training_curves_of_both_paths_match(tmp_path):
    """25 steps of distill (temperature, cross-entropy, every parameter trained, the untied head too, several chunks
    per micro-batch): the fused path follows the full-logits one step by step."""
    rows = torch.randint(0, 97, (16, 24), generator=torch.Generator().manual_seed(0))
    curves = {}
    for head in ("logits", "fused"):
        student, teacher = _pair("llama", False)
        args = TrainArgs(tokens=25 * 2 * 24, batch_size=2, lr=1e-3, train="all", temperature=1.5, ce_weight=0.2,
                         head=head, kl_chunk=20, log_every=1, eval_every=25, save_every=100, compile=False)
        with one_thread():
            report = distill(student, teacher, rows, rows[:2], args, tmp_path / head, resume=False, eval_batch_size=2)
        recs = [json.loads(r) for r in (tmp_path / head / "metrics.jsonl").read_text().splitlines()]
        curves[head] = [r["loss"] for r in recs if "kl" in r], report
    (lc, lr), (fc, fr) = curves["logits"], curves["fused"]
    assert len(lc) == len(fc) == 25 and lc[-1] < lc[0]  # it learns
    assert max(abs(a - b) for a, b in zip(lc, fc)) <= 1e-4 * max(lc), (lc, fc)
    assert fr["heldout_loss"] == pytest.approx(lr["heldout_loss"], rel=1e-4)
