"""What align and distill share (training.py): the learning-rate schedules, the row order, the mixed-precision
rule and the attention implementation for training rows."""
import pytest
import torch
from conftest import tiny_teacher

from taylor_calibrate import GDNConfig, convert_teacher
from taylor_calibrate.distill import trainable_names
from taylor_calibrate.training import (batch_indices, hold_frozen, release_frozen, resolve_attention, restore_attention,
                                       swap_attention, warmup_cosine, wsd)


def test_warmup_cosine_is_distills_schedule():
    assert warmup_cosine(1, 100, 10) == pytest.approx(0.1) and warmup_cosine(10, 100, 10) == pytest.approx(1.0)
    assert warmup_cosine(100, 100, 10) == pytest.approx(0.1) and 0.1 < warmup_cosine(50, 100, 10) < 1.0
    assert warmup_cosine(1, 5, 0) < 1.0  # no warmup: the cosine from the first step


def test_wsd_is_flat_then_straight_down_and_the_last_step_still_moves():
    assert all(wsd(s, 100, 0.2) == 1.0 for s in (1, 50, 80)) and wsd(90, 100, 0.2) == pytest.approx(0.51)
    assert wsd(100, 100, 0.2) == pytest.approx(0.01)
    assert wsd(50, 100, 0.5) == 1.0 and wsd(75, 100, 0.5) == pytest.approx(0.51)


def test_batch_indices_are_seeded_epochs():
    rows = batch_indices(5, 2, 7, seed=3)  # 14 indices: two full epochs + 4 of the third
    assert rows.shape == (7, 2)
    flat = rows.flatten()
    assert sorted(flat[:5].tolist()) == list(range(5)) and sorted(flat[5:10].tolist()) == list(range(5))
    assert torch.equal(rows, batch_indices(5, 2, 7, seed=3))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_hold_frozen_keeps_frozen_weights_in_bf16_and_trains_the_rest_in_fp32(arch):
    """What distill does on CUDA, run under CPU autocast: frozen parameters (embedding, MLPs, kept heads) in bf16, the
    GDN mixers' fp32 master weights get fp32 gradients, the residual stream is bf16; fp32 again afterwards, equal to
    the bf16-rounded originals. Nothing is held on CPU."""
    hybrid = convert_teacher(tiny_teacher(arch), [1, 2], GDNConfig(), kept_groups={1: [0]}).float()
    trained = set(trainable_names(hybrid, "mixers"))
    for n, p in hybrid.named_parameters():
        p.requires_grad_(n in trained)
    before = {n: p.detach().clone() for n, p in hybrid.named_parameters()}
    assert hold_frozen(hybrid, torch.device("cpu")) == []
    held = hold_frozen(hybrid, torch.device("cuda"))  # the device only picks the rule; nothing moves
    assert held and all(p.dtype == torch.bfloat16 for p in held)
    assert {n for n, p in hybrid.named_parameters() if p.dtype == torch.float32} == trained
    ids = torch.randint(0, hybrid.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = hybrid(input_ids=ids, use_cache=False, output_hidden_states=True)
        out.logits.float().logsumexp(-1).mean().backward()
    assert out.hidden_states[0].dtype == torch.bfloat16  # the embedding's output: a bf16 residual stream
    for n, p in hybrid.named_parameters():
        assert (p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()) == (n in trained), n
    release_frozen(held)
    for n, p in hybrid.named_parameters():
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), before[n].to(torch.bfloat16).float() if n not in trained else before[n],
                                   rtol=0, atol=0)


def test_auto_attention_takes_flex_on_cuda_only_for_rows_longer_than_a_window():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    gemma = tiny_teacher("gemma3_text")  # window 8 on three of four layers
    assert resolve_attention("auto", gemma.config, 64, cuda) == "flex_attention"
    assert resolve_attention("auto", gemma.config, 8, cuda) == "sdpa"  # the window covers the row
    assert resolve_attention("auto", gemma.config, 64, cpu) == "sdpa"
    assert resolve_attention("auto", tiny_teacher("mistral").config, 64, cuda) == "flex_attention"  # window 32
    for arch in ("llama", "qwen2"):  # no windows (Qwen2 without use_sliding_window)
        assert resolve_attention("auto", tiny_teacher(arch).config, 4096, cuda) == "sdpa"
    hybrid = convert_teacher(gemma, [3], GDNConfig())  # the global layer converted: the windows stay
    assert resolve_attention("auto", hybrid.config, 64, cuda) == "flex_attention"
    assert resolve_attention("sdpa", gemma.config, 64, cuda) == "sdpa"
    with pytest.raises(ValueError, match="attention"):
        resolve_attention("flash", gemma.config, 64, cpu)
    with pytest.raises(ValueError, match="CUDA only.*sdpa or auto"):  # named on a CPU: a clear error, not torch's
        resolve_attention("flex_attention", gemma.config, 64, cpu)


@pytest.mark.parametrize("arch", ["gemma3_text", "mistral"])
def test_flex_attention_gives_the_sdpa_hybrid_and_teacher_on_rows_past_the_window(arch, monkeypatch):
    """The same logits from flex_attention's block mask as from sdpa's dense window mask (rows 5 windows long; a
    head-wise layer's kept heads too), and each model's own implementation back after `restore_attention`.

    flex_attention runs uncompiled here: transformers compiles it, and torch's compiled CPU kernel with grouped KV
    heads gave wrong outputs (and NaN) on an AMD EPYC test machine, against sdpa and against the same call uncompiled;
    flex_attention is taken on CUDA only (`resolve_attention`), and what this test checks is the masks."""
    import transformers.integrations.flex_attention as hf_flex
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: flex_attention(q, k, v, **kw))
    teacher = tiny_teacher(arch)
    teacher.set_attn_implementation("sdpa")
    hybrid = convert_teacher(teacher, [1, 3], GDNConfig(), kept_groups={1: [0]}).float().eval()
    ids = torch.randint(0, 97, (2, 5 * teacher.config.sliding_window))
    with torch.no_grad():
        want = [m(ids).logits for m in (hybrid, teacher)]
        before = swap_attention([hybrid, teacher], "flex_attention")
        assert hybrid.model.layers[1].self_attn.attn.config._attn_implementation == "flex_attention"
        got = [m(ids).logits for m in (hybrid, teacher)]
        restore_attention(before)
    assert [m.config._attn_implementation for m in (hybrid, teacher)] == ["sdpa", "sdpa"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_distill_trains_with_the_attention_asked_for_and_hands_the_models_back_with_their_own(tmp_path):
    """distill runs teacher and student with --train.attention (sdpa here, for models that use eager attention);
    the on_step hook (recovery's generate) and the caller get each model's own implementation back."""
    from taylor_calibrate.config import TrainArgs
    from taylor_calibrate.distill import distill

    teacher = tiny_teacher("gemma3_text")
    student = convert_teacher(teacher, [3], GDNConfig()).float()
    student.set_attn_implementation("eager")
    seen = {"forward": set(), "hook": set()}
    attn = student.model.layers[0].self_attn
    attn.register_forward_pre_hook(lambda m, a: seen["forward"].add(m.config._attn_implementation))
    rows = torch.randint(0, 97, (8, 24), generator=torch.Generator().manual_seed(0))
    args = TrainArgs(tokens=2 * 4 * 24, batch_size=4, lr=1e-3, attention="sdpa", log_every=1, compile=False)
    distill(student, teacher, rows, rows[:2], args, tmp_path / "run", resume=False, eval_batch_size=2,
            on_step=lambda step, s: seen["hook"].add(s.config._attn_implementation))
    assert seen["hook"] == {"eager"} and "sdpa" in seen["forward"]  # (the fused loss's head check runs before)
    assert (student.config._attn_implementation, teacher.config._attn_implementation) == ("eager", "eager")


def test_the_on_step_hook_runs_compiled_layers_eagerly(tmp_path, monkeypatch):
    """recovery's hook generates between training steps: its new shapes and the student's own attention would make
    dynamo trace every compiled layer again (and past its limit, run layers eager in silence). The hook runs the
    layers eagerly: no graph is traced while it runs, while the training steps around it use the compiled layers."""
    import torch._dynamo

    from taylor_calibrate import distill as distill_mod
    from taylor_calibrate.config import TrainArgs

    graphs = torch._dynamo.utils.counters["stats"]
    # dynamo's "eager" backend: it traces and guards as with inductor, without building kernels on this CPU
    monkeypatch.setattr(distill_mod, "compile_layers",
                        lambda *ms: [layer.compile(backend="eager") for m in ms for layer in m.model.layers])
    teacher = tiny_teacher("llama")
    student = convert_teacher(teacher, [1], GDNConfig()).float()
    rows = torch.randint(0, 97, (8, 24), generator=torch.Generator().manual_seed(0))
    traced = []

    def hook(step, s):
        before = graphs["unique_graphs"]
        for n in (5, 9):
            s.generate(rows[:1, :n], max_new_tokens=3, do_sample=False)
        traced.append(graphs["unique_graphs"] - before)

    start = graphs["unique_graphs"]
    args = TrainArgs(tokens=2 * 4 * 24, batch_size=4, lr=1e-3, log_every=1, compile=True, loss_kernel="torch")
    distill_mod.distill(student, teacher, rows, rows[:2], args, tmp_path / "run", resume=False, eval_batch_size=2,
                        on_step=hook)
    assert graphs["unique_graphs"] > start  # the training steps ran compiled layers
    assert len(traced) >= 2 and traced == [0] * len(traced)
