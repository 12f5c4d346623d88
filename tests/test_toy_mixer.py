"""A second mixer plugs in through its spec and one registration line: the test-only toy (tests/toy_mixer) converts,
calibrates, aligns, saves, loads and generates on the same code path as GDN."""
import pytest
import torch
from conftest import decoded_logits, tiny_teacher
from toy_mixer import TOY_SPEC, ToyConfig, ToyGLA
from transformers import AutoModelForCausalLM

from taylor_calibrate import HybridForCausalLM, convert_teacher
from taylor_calibrate.align import align_layers
from taylor_calibrate.calibrate import calibrated_mixers
from taylor_calibrate.config import AlignArgs, CalibArgs
from taylor_calibrate.distill import trainable_names
from taylor_calibrate.checkpoint import load_model, save_hybrid
from taylor_calibrate.model.mixers import MIXERS
from taylor_calibrate.stats import attention_targets, collect_stats

LAYERS = [1, 2, 3]
KEPT = {3: [0]}  # layer 3 head-wise: KV group 0 stays attention


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(MIXERS, "toy", TOY_SPEC)  # the one registration line


@pytest.fixture(scope="module")
def teacher_stats():
    teacher = tiny_teacher("llama").requires_grad_(False)
    ids = torch.randint(0, 97, (6, 32), generator=torch.Generator().manual_seed(0))
    return teacher, collect_stats(teacher, ids, store_layers=LAYERS)


def test_unregistered_mixer_is_a_clear_error(teacher_stats):
    with pytest.raises(ValueError, match="not the options of a registered mixer"):
        convert_teacher(teacher_stats[0], LAYERS, ToyConfig())


def test_a_mixer_without_an_export_form_is_a_clear_error(toy):
    """`export --format qwen3_5` and `--target qwen3_5` read the mixer's form from its spec: a mixer without one was a
    bare KeyError."""
    with pytest.raises(ValueError, match=r"the 'toy' mixer has no qwen3_5 form \(its exports: none\)"):
        TOY_SPEC.export("qwen3_5")
    assert MIXERS["gdn"].export("qwen3_5") is MIXERS["gdn"].exports["qwen3_5"]


def test_toy_mixer_calibrates_aligns_saves_loads_and_generates(toy, teacher_stats, tmp_path, single_thread):
    teacher, stats = teacher_stats
    with pytest.raises(ValueError, match="not one of"):  # GDN's methods are GDN's
        calibrated_mixers(teacher, stats, LAYERS, "taylor", CalibArgs(), ToyConfig(), "torch", kept_groups=KEPT)
    copy, _ = calibrated_mixers(teacher, stats, LAYERS, "copy", CalibArgs(), ToyConfig(), "torch", kept_groups=KEPT)
    mixers, report = calibrated_mixers(teacher, stats, LAYERS, "half_life", CalibArgs(), ToyConfig(), "torch",
                                       kept_groups=KEPT)
    assert all(isinstance(m, ToyGLA) for m in mixers.values()) and mixers[3].num_heads == 2
    assert set(report) == set(LAYERS) and not torch.equal(copy[1].decay_bias, mixers[1].decay_bias)
    assert torch.equal(copy[1].q_proj.weight, teacher.model.layers[1].self_attn.q_proj.weight)

    targets = attention_targets(teacher, stats, LAYERS, kept_groups=KEPT)
    args = AlignArgs(steps=8, batch_size=2, lr_qkv=1e-3, log_every=4)
    before = {i: m.a_proj.weight.clone() for i, m in mixers.items()}
    rep = align_layers(mixers, {i: stats.inputs[i] for i in LAYERS}, targets, args)
    assert rep["mean_rel_mse_after"] < rep["mean_rel_mse_before"]
    assert any(not torch.equal(before[i], m.a_proj.weight) for i, m in mixers.items())  # dynamics group trains

    hybrid = convert_teacher(teacher, LAYERS, ToyConfig(), mixers=mixers, kept_groups=KEPT)
    assert hybrid.config.mixer == "toy" and isinstance(hybrid.model.layers[3].self_attn.gdn, ToyGLA)
    names = trainable_names(hybrid, "gdn")
    assert "model.layers.3.self_attn.gdn.decay_bias" in names and "model.layers.1.self_attn.decay_bias" in names
    save_hybrid(hybrid, None, tmp_path / "toy")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "toy", attn_implementation="eager").eval()
    assert isinstance(loaded, HybridForCausalLM) and loaded.config.mixer == "toy"
    again, _ = load_model(tmp_path / "toy")
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = loaded(ids, use_cache=False).logits
        torch.testing.assert_close(full, hybrid(ids, use_cache=False).logits)
        torch.testing.assert_close(again(ids, use_cache=False).logits, full)
        torch.testing.assert_close(decoded_logits(loaded, ids, 11), full, rtol=1e-4, atol=1e-4)
        out = loaded.generate(ids[:1, :8], max_new_tokens=5, do_sample=False)
        assert out.shape == (1, 13)
        assert torch.equal(out, loaded.generate(ids[:1, :8], max_new_tokens=5, do_sample=False, use_cache=False))
    assert TOY_SPEC.state_bytes(ToyConfig(), 4, 16, 4) == 4 * 16 * 16 * 4


def test_toy_mixer_through_the_convert_stage(toy, tmp_path, single_thread):
    """`convert` with the toy's options in place of GDN's: statistics, phase 1 (copy), phase 2, evaluation and the
    saved directory, on the command's own code path."""
    from conftest import tiny_local_teacher

    from taylor_calibrate.config import ConvertArgs, DataArgs
    from taylor_calibrate.convert import run_convert

    teacher, corpus = tiny_local_teacher(tmp_path)
    args = ConvertArgs(teacher=str(teacher), out=str(tmp_path / "toy"), init="copy", policy="uniform", keep_every=2,
                       device="cpu", backend="torch", gdn=ToyConfig(), probe_samples=1,
                       phase2=AlignArgs(steps=2, batch_size=2),
                       data=DataArgs(source=str(corpus), seq_len=32, calib_seqs=2, eval_seqs=2))
    report = run_convert(args)
    assert report["gdn_layers"] and report["phase2"]["layers"]
    loaded, _ = load_model(tmp_path / "toy")
    assert loaded.config.mixer == "toy"
    assert all(isinstance(m, ToyGLA) for m in loaded.gdn_mixers.values())
