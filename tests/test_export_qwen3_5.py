"""Export to Qwen3.5 (taylor_calibrate/export/qwen3_5.py): transformers' own Qwen3_5ForCausalLM, run in a subprocess that never
imports our package, gives our hybrid's logits."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from taylor_calibrate.config import GDNConfig
from taylor_calibrate.checkpoint import save_hybrid
from taylor_calibrate.model.hybrid import convert_teacher
from taylor_calibrate.export.qwen3_5 import export_qwen3_5, full_attention_interval, mrope_section

from conftest import tiny_teacher

EXPRESSIBLE = dict(qk_activation="silu", v_activation="silu", gate="swish", output_norm=True)

# Runs in a fresh interpreter with our package off the path: loads the export with transformers' own class (no
# trust_remote_code), writes its logits, greedy tokens and a save/load round trip's logits.
_RUN_TRANSFORMERS = textwrap.dedent("""
    import sys, torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM
    src, ids_file, out_file, resaved = sys.argv[1:5]
    ids = load_file(ids_file)["ids"]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert type(model) is Qwen3_5ForCausalLM, type(model)
    with torch.no_grad():
        logits = model(ids).logits
        greedy = model.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, min_new_tokens=6)
        model.save_pretrained(resaved)
        again = Qwen3_5ForCausalLM.from_pretrained(resaved, dtype=torch.float32).eval()(ids).logits
    assert "taylor_calibrate" not in sys.modules
    save_file({"logits": logits, "greedy": greedy, "again": again}, out_file)
""")


def run_transformers(export_dir, ids, tmp_path) -> dict[str, torch.Tensor]:
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _RUN_TRANSFORMERS, str(export_dir), str(tmp_path / "ids.safetensors"),
                           str(tmp_path / "out.safetensors"), str(tmp_path / "resaved")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(tmp_path / "out.safetensors"))


@torch.no_grad()
def tiny_hybrid(arch="qwen3", gdn_layers=(0, 1, 2), seed=0, vocab_size=97, tie=False, **gdn_over):
    """A tiny hybrid whose every parameter (norms, convs, gates) is off its default, so each map is exercised."""
    teacher = tiny_teacher(arch, seed=seed, vocab_size=vocab_size, tie_word_embeddings=tie)
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in teacher.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    gdn = GDNConfig(**{**EXPRESSIBLE, "norm_eps": teacher.config.rms_norm_eps, **gdn_over})
    hybrid = convert_teacher(teacher, list(gdn_layers), gdn)
    for i, m in hybrid.gdn_mixers.items():
        if m.o_norm is not None:
            m.o_norm.weight.copy_(1 + 0.3 * torch.randn(m.o_norm.weight.shape, generator=g))
        m.b_proj.weight.mul_(20)  # beta away from 1/2, decay spread: the recurrence matters
        m.a_proj.weight.mul_(20)
    return teacher, hybrid


def _ids(vocab, seed=0, rows=2, T=40):
    return torch.randint(0, vocab, (rows, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("gdn_layers,short_conv,interval", [((0, 1, 2), "random", 4), ((1, 2, 3), "none", None),
                                                              ((0, 2), "identity", 2)])
def test_qwen3_export_matches_ours(tmp_path, gdn_layers, short_conv, interval):
    _, hybrid = tiny_hybrid(gdn_layers=gdn_layers, short_conv=short_conv)
    save_hybrid(hybrid, None, tmp_path / "hybrid")
    export_qwen3_5(tmp_path / "hybrid", tmp_path / "qwen3_5")
    ids = _ids(hybrid.config.vocab_size)
    with torch.no_grad():
        ours = hybrid(ids, use_cache=False).logits
        our_greedy = hybrid.generate(ids[:1, :8], max_new_tokens=6, do_sample=False, min_new_tokens=6)
    theirs = run_transformers(tmp_path / "qwen3_5", ids, tmp_path)
    assert (ours - theirs["logits"]).abs().max() < 1e-4
    assert (ours - theirs["again"]).abs().max() < 1e-4  # through transformers' save_pretrained / from_pretrained
    assert torch.equal(our_greedy, theirs["greedy"])  # cached decode: conv and recurrent state carried alike
    cfg = json.loads((tmp_path / "qwen3_5" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["partial_rotary_factor"] == 1.0
    assert cfg["layer_types"] == ["linear_attention" if i in gdn_layers else "full_attention" for i in range(4)]
    assert cfg.get("full_attention_interval") == interval


def test_tied_embeddings(tmp_path):
    _, hybrid = tiny_hybrid(tie=True)
    save_hybrid(hybrid, None, tmp_path / "hybrid")
    export_qwen3_5(tmp_path / "hybrid", tmp_path / "qwen3_5")
    ids = _ids(hybrid.config.vocab_size)
    with torch.no_grad():
        ours = hybrid(ids, use_cache=False).logits
    assert (ours - run_transformers(tmp_path / "qwen3_5", ids, tmp_path)["logits"]).abs().max() < 1e-4


def test_layer_pattern_helpers():
    G, A = "linear_attention", "full_attention"
    assert full_attention_interval([G, G, G, A] * 3) == 4
    assert full_attention_interval([A, G, G, G] * 3) is None  # the uniform policy keeps layer 0: not Qwen's pattern
    assert full_attention_interval([A] * 4) == 1
    assert sum(mrope_section(64)) == 32 and sum(mrope_section(16)) == 8


@pytest.mark.parametrize("over,needle", [
    (dict(v_activation="identity"), "--gdn.v_activation='identity'"),
    (dict(gate="sigmoid"), "--gdn.gate='sigmoid'"),
    (dict(output_norm=False), "--gdn.output_norm=False"),
    (dict(qk_activation="identity"), "--gdn.qk_activation"),
    (dict(norm_eps=1e-3), "--gdn.norm_eps"),
])
def test_unsupported_gdn_options_are_refused(tmp_path, over, needle):
    _, hybrid = tiny_hybrid(**over)
    save_hybrid(hybrid, None, tmp_path / "hybrid")
    with pytest.raises(ValueError, match="cannot be exported exactly") as e:
        export_qwen3_5(tmp_path / "hybrid", tmp_path / "out")
    assert needle in str(e.value)
    assert not (tmp_path / "out").exists()


def test_teacher_without_qk_norm_is_refused_with_the_fix(tmp_path):
    _, hybrid = tiny_hybrid("llama")
    save_hybrid(hybrid, None, tmp_path / "hybrid")
    with pytest.raises(ValueError, match="--target qwen3_5"):
        export_qwen3_5(tmp_path / "hybrid", tmp_path / "out")


def test_export_never_overwrites(tmp_path):
    _, hybrid = tiny_hybrid()
    save_hybrid(hybrid, None, tmp_path / "hybrid")
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError):
        export_qwen3_5(tmp_path / "hybrid", tmp_path / "out")


# --- convert --target qwen3_5: teachers without q/k norm -----------------------------------------------------------
def local_teacher(root, arch):
    """(teacher_dir, corpus_dir): a saved random `arch` model with an offline tokenizer, and its corpus."""
    from conftest import VOCAB, tiny_corpus, tiny_tokenizer
    corpus = tiny_corpus(root / "corpus")
    tokenizer = tiny_tokenizer([p.read_text() for p in sorted(corpus.iterdir())])
    # an embedding padded past the tokenizer, as real checkpoints have (transformers' Qwen2Tokenizer adds
    # <|endoftext|> at id VOCAB to a tokenizer.json that lacks it)
    teacher = tiny_teacher(arch, vocab_size=VOCAB + 4, initializer_range=0.1)
    teacher.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    return root / "teacher", corpus


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_target_qwen3_5_converts_exports_and_loads(tmp_path, arch):
    from conftest import one_thread

    from taylor_calibrate.cli import main
    from taylor_calibrate.checkpoint import load_model

    teacher_dir, corpus = local_teacher(tmp_path, arch)
    out, served = tmp_path / "hybrid", tmp_path / "served"
    with one_thread():
        assert main(["convert", "--teacher", str(teacher_dir), "--target", "qwen3_5", "--device", "cpu", "--backend",
                     "torch", "--data.source", str(corpus), "--data.seq_len", "32", "--data.calib_seqs", "4",
                     "--data.eval_seqs", "2", "--phase2.steps", "6", "--phase2.batch_size", "2", "--phase2.log_every",
                     "2", "--out", str(out)]) == 0
        assert main(["export", "--model", str(out), "--format", "qwen3_5", "--out", str(served)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["target"] == "qwen3_5" and report["args"]["gdn"]["v_activation"] == "silu"
    attn = report["phase2_attention"]
    assert sorted(int(k) for k in attn["layers"]) == report["kept_layers"]
    assert attn["mean_rel_mse_after"] <= attn["mean_rel_mse_before"]  # best state: never worse than the fitted start
    hybrid, tokenizer = load_model(out)
    ids = tokenizer("the river moves slowly over quiet hills", return_tensors="pt").input_ids.repeat(2, 1)
    with torch.no_grad():
        ours = hybrid(ids, use_cache=False).logits
    theirs = run_transformers(served, ids, tmp_path)
    assert (ours - theirs["logits"]).abs().max() < 1e-4  # the exported model is the model convert measured
    assert (served / "tokenizer.json").exists() and (served / "generation_config.json").exists()
    if arch == "llama":  # `eval` reads the export with transformers' class: the held-out perplexity convert measured
        data = ["--data.source", str(corpus), "--data.seq_len", "32", "--data.eval_seqs", "2", "--device", "cpu"]
        with one_thread():
            assert main(["eval", "--model", str(served), "--out", str(tmp_path / "eval"), *data]) == 0
        served_ppl = json.loads((tmp_path / "eval" / "report.json").read_text())["model_ppl"]
        assert served_ppl == pytest.approx(report["hybrid_ppl"], rel=1e-4)


def test_cli_export_of_an_unsupported_hybrid_is_a_clear_error(tmp_path, capsys):
    from taylor_calibrate.cli import main

    _, hybrid = tiny_hybrid(v_activation="identity")
    save_hybrid(hybrid, None, tmp_path / "hybrid")
    assert main(["export", "--model", str(tmp_path / "hybrid"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cannot be exported exactly to qwen3_5" in err and "--gdn.v_activation='identity'" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_target_qwen3_5_refuses_gemma3_with_the_reason():
    from taylor_calibrate.export.qwen3_5 import qwen3_form

    with pytest.raises(ValueError, match="Gemma 3"):
        qwen3_form(tiny_teacher("gemma3_text"))


# --- the closed-form start of the added q/k RMSNorm (start_qk_norm) ------------------------------------------------
def _kept_attention(arch, shared: float = 3.0):
    """(teacher attention, its Qwen3-form copy, rotary, inputs): inputs with a shared direction of size `shared` x their
    spread, as real residual streams have (SmolLM2's attention inputs: x.d spreads by about 2% over tokens)."""
    from taylor_calibrate.export.qwen3_5 import qwen3_form

    teacher = tiny_teacher(arch, initializer_range=0.2)
    form = qwen3_form(teacher)
    g = torch.Generator().manual_seed(3)
    e = torch.randn(teacher.config.hidden_size, generator=g)
    x = torch.randn(4, 48, teacher.config.hidden_size, generator=g) + shared * e / e.norm() * 8
    return teacher.model.layers[1].self_attn, form.model.layers[1].self_attn, form.model.rotary_emb, x


def _qk(attn, x, normed):
    B, T, _ = x.shape
    D = attn.head_dim
    q, k = attn.q_proj(x).view(B, T, -1, D), attn.k_proj(x).view(B, T, -1, D)
    return (attn.q_norm(q), attn.k_norm(k)) if normed else (q, k)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.no_grad()
def test_start_qk_norm_keeps_the_teachers_q_and_k_but_one_pair(arch):
    """Normed q and k equal the teacher's on every dim but the spent pair, times one factor per token and head; the
    factor's spread over tokens and heads is the constant's: that of x.d (plus 1/256 from b's size), only the latter
    where the teacher has a bias (Qwen2), so attention keeps its temperature and pattern. The pair's logit term is 0
    (q norm weight 0 there)."""
    from taylor_calibrate.model.mixers.calibration import constant_direction
    from taylor_calibrate.export.qwen3_5 import start_qk_norm

    teacher_attn, attn, rotary, x = _kept_attention(arch)
    pair = start_qk_norm(attn, rotary, x)
    D = attn.head_dim
    spent = torch.zeros(D, dtype=torch.bool)
    spent[[pair, pair + D // 2]] = True
    assert (attn.q_norm.weight[spent] == 0).all()
    xf = x.reshape(-1, x.shape[-1])
    u = xf @ constant_direction(xf, anchor=x[:, 0].mean(0))
    spread = (u.std() / u.mean()).item() if arch == "llama" else 0.0
    for normed, raw in zip(_qk(attn, x, True), _qk(teacher_attn, x, False)):
        a, b = normed[..., ~spent], raw[..., ~spent]
        f = (a * b).sum(-1) / (b * b).sum(-1)  # (B, T, heads)
        torch.testing.assert_close(a, f[..., None] * b, rtol=1e-4, atol=1e-5 * b.abs().max().item())
        assert (f.std() / f.mean()).item() <= 1.1 * spread + 1 / 256


@torch.no_grad()
def test_spare_pair_is_a_pair_attention_does_not_use():
    from taylor_calibrate.export.qwen3_5 import spare_pair

    teacher_attn, attn, rotary, x = _kept_attention("llama")
    D = attn.head_dim
    for p in (0, 5):
        w = attn.q_proj.weight.view(-1, D, x.shape[-1])
        w[:, [p, p + D // 2]] = 0  # the pair's logit term is 0 for every query and key
        assert spare_pair(attn, rotary, x) == p
        w.copy_(teacher_attn.q_proj.weight.view_as(w))
