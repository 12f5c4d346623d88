"""The `distill` stage on a tiny local teacher: it learns, it reports, a killed run resumes as if uninterrupted,
and 2 processes under torchrun (gloo) follow the 1-process loss curve."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import VOCAB, one_thread, tiny_config, tiny_local_teacher, tiny_tokenizer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from taylor_calibrate.cli import main
from taylor_calibrate.config import GDNConfig
from taylor_calibrate.checkpoint import save_hybrid
from taylor_calibrate.model.hybrid import convert_teacher

GDN_LAYERS = [1, 3]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    teacher_dir, corpus = tiny_local_teacher(root)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    student = convert_teacher(teacher, GDN_LAYERS, GDNConfig(), teacher_name=str(teacher_dir))
    save_hybrid(student, AutoTokenizer.from_pretrained(teacher_dir), root / "student")
    return root, teacher_dir, corpus


def _argv(root, corpus, out, steps, *more):
    return ["distill", "--student", str(root / "student"), "--out", str(out), "--device", "cpu", "--backend", "torch",
            "--data.source", str(corpus), "--data.seq_len", "32", "--data.eval_seqs", "2", "--eval_batch_size", "2",
            "--train.tokens", str(steps * 4 * 32), "--train.batch_size", "4", "--train.lr", "1e-2",
            "--train.log_every", "1", *more]


def _records(out):
    return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def test_distill_learns_and_reports(assets, caplog):
    root, teacher_dir, corpus = assets
    out = root / "run"
    with one_thread(), caplog.at_level("WARNING", logger="taylor_calibrate"):
        assert main(_argv(root, corpus, out, 24, "--train.eval_every", "12")) == 0
    assert not [r for r in caplog.records if "above the" in r.getMessage()]  # learning: no divergence warning
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 24 and report["tokens"] == 24 * 4 * 32 and report["teacher"] == str(teacher_dir)
    assert report["eval_tokens"] == [0, 12 * 128, 24 * 128]
    kl = report["heldout_kl"]
    assert kl[2] < kl[1] < kl[0] and kl[2] < 0.95 * kl[0], kl  # it learns the teacher (2 rows: a noisy measure)
    assert report["tokens_per_s"] > 0 and report["mfu"] is None  # no peak FLOP/s known for a CPU
    recs = _records(out)
    train = [r for r in recs if "kl" in r]
    assert [r["step"] for r in train] == list(range(1, 25))
    assert all(math.isfinite(r["loss"]) and r["loss"] == pytest.approx(r["kl"]) for r in train)
    # only the converted mixers trained; everything else is the teacher's, bit for bit
    before = AutoModelForCausalLM.from_pretrained(root / "student").state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    for k, v in before.items():
        mixer = any(k.startswith(f"model.layers.{i}.self_attn.") for i in GDN_LAYERS)
        if mixer and k.endswith(("q_proj.weight", "a_proj.weight", "o_proj.weight")):
            assert not torch.equal(v, after[k]), f"{k} did not train"
        elif not mixer:
            assert torch.equal(v, after[k]), f"frozen {k} changed"


def test_a_student_moving_away_from_the_teacher_is_warned_of(assets, caplog):
    """A held-out KL above the one the student started from (here a learning rate far too high) is logged with the
    fix, at each evaluation where it happens; the run still finishes."""
    root, _, corpus = assets
    out = root / "too_high"
    with one_thread(), caplog.at_level("WARNING", logger="taylor_calibrate"):
        assert main(_argv(root, corpus, out, 4, "--train.lr", "0.3", "--train.eval_every", "2")) == 0
    kl = json.loads((out / "report.json").read_text())["heldout_kl"]
    warned = [r.getMessage() for r in caplog.records if "above the" in r.getMessage()]
    assert len(warned) == sum(k > kl[0] for k in kl[1:]) > 0, (kl, warned)
    assert all("--train.lr 0.3 may be too high" in w for w in warned)


def test_hidden_state_and_cross_entropy_terms_add_to_the_loss(assets):
    """--train.hidden_weight / --train.ce_weight: each step's loss is kl + w_h x hidden-state rel-MSE + w_ce x CE,
    every part finite and positive (the hybrid's hidden states differ from the teacher's past its first GDN layer)."""
    root, _, corpus = assets
    out = root / "parts"
    with one_thread():
        assert main(_argv(root, corpus, out, 2, "--train.hidden_weight", "2.0", "--train.ce_weight", "0.5")) == 0
    train = [r for r in _records(out) if "kl" in r]
    assert len(train) == 2
    for r in train:
        assert r["hidden_mse"] > 0 and r["ce"] > 0 and r["kl"] > 0
        assert r["loss"] == pytest.approx(r["kl"] + 2.0 * r["hidden_mse"] + 0.5 * r["ce"], rel=1e-5)


def test_far_weight_weighs_the_kl_by_the_teachers_far_attention(assets):
    """--train.far_weight: the teacher's far attention mass (its converted heads, keys >= 16 back, sink out) weighs
    each token's KL; the weights follow eager attention, and the run trains differently from the unweighted one."""
    from taylor_calibrate.model.hybrid import gdn_heads
    from taylor_calibrate.stats import BAND, FarMass, observing

    root, teacher_dir, corpus = assets
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    student = AutoModelForCausalLM.from_pretrained(root / "student")
    layers = student.config.gdn_layers
    heads = gdn_heads(teacher.config, layers, {i: student.config.kept_groups(i) for i in layers})
    assert sorted(heads) == GDN_LAYERS and all(len(h) == teacher.config.num_attention_heads for h in heads.values())
    ids = torch.randint(0, teacher.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    far = FarMass(heads, block=16)
    with torch.no_grad(), one_thread():
        with observing(teacher, far):
            out = teacher(input_ids=ids, use_cache=False)
        teacher.set_attn_implementation("eager")
        eager = teacher(input_ids=ids, use_cache=False, output_attentions=True)
        teacher.set_attn_implementation("sdpa")
    torch.testing.assert_close(out.logits, eager.logits, rtol=1e-4, atol=1e-4)  # observing leaves the outputs alone
    t, s = torch.arange(40)[:, None], torch.arange(40)[None, :]
    mass = torch.stack([(eager.attentions[i] * ((t - s >= BAND) & (s > 0))).sum(-1).mean(1) for i in GDN_LAYERS])
    want = 1 + 3.0 * mass.mean(0)
    torch.testing.assert_close(far.weights(3.0), want / want.mean(), rtol=1e-4, atol=1e-5)

    runs = {}
    for weight in ("0", "3"):
        out_dir = root / f"far{weight}"
        with one_thread():
            assert main(_argv(root, corpus, out_dir, 2, "--train.far_weight", weight)) == 0
        runs[weight] = [r["kl"] for r in _records(out_dir) if "kl" in r]
    assert runs["0"][0] != pytest.approx(runs["3"][0], rel=1e-6) and all(math.isfinite(k) for k in runs["3"])


@pytest.mark.parametrize("embedding", ["trained", "frozen"])
def test_checkpoint_of_a_tied_model_reads_back(tmp_path, embedding):
    """A model whose lm_head shares the embedding (SmolLM2 and Gemma 3 both do) checkpoints its trained parameters
    once, not again under the tied name, and the checkpoint reads back; one that holds the tied name as well (as
    written before) reads too."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from taylor_calibrate.distill import Dist, read_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.requires_grad_(False)
    model.model.layers[0].self_attn.requires_grad_(True)
    model.model.embed_tokens.requires_grad_(embedding == "trained")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(input_ids=torch.arange(8)[None]).logits.float().pow(2).mean().backward()
    opt.step()
    save_checkpoint(tmp_path, 1, model, opt, Dist(), {})
    ck = tmp_path / "checkpoints" / "step_00000001"
    saved = load_file(str(ck / "model.safetensors"))
    want = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(saved) == want and "lm_head.weight" not in saved
    assert ("model.embed_tokens.weight" in saved) == (embedding == "trained")
    assert set(read_checkpoint(ck, model)[1]) == want
    save_file({**saved, "lm_head.weight": model.lm_head.weight.detach().clone()}, str(ck / "model.safetensors"))
    assert set(read_checkpoint(ck, model)[1]) == want  # the tied name as well: read as before


def _run(argv, env_extra=None, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "taylor_calibrate", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _weights(out):
    return load_file(str(out / "model" / "model.safetensors"))


def test_killed_run_resumes_as_if_uninterrupted(assets):
    """SIGKILL mid-run (checkpoints every step, so likely mid-save), resume, compare with an unbroken run: the same
    weights and loss records, so the same data order (token-shard windows chosen by the step alone)."""
    root, _, corpus = assets
    steps = 150
    ref, broken = root / "ref", root / "broken"
    p = _run(_argv(root, corpus, ref, steps, "--train.save_every", "50"))
    assert p.wait(timeout=300) == 0, p.stdout.read()

    p = _run(_argv(root, corpus, broken, steps, "--train.save_every", "1"))
    latest = broken / "checkpoints" / "latest.json"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if latest.exists():
            try:
                if json.loads(latest.read_text())["step"] >= 20:
                    break
            except ValueError:
                pass
        time.sleep(0.005)
    assert p.poll() is None, "the run finished before it could be killed; raise `steps`"
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = json.loads(latest.read_text())["step"]
    assert 20 <= killed_at < steps
    p = _run(_argv(root, corpus, broken, steps, "--train.save_every", "1"))
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log
    assert "resuming" in log and "tokenised" not in log  # the restart reads the shards the first start wrote
    report = json.loads((broken / "report.json").read_text())
    assert report["resumed_from"] is not None and report["resumed_from"] >= killed_at

    a, b = _weights(ref), _weights(broken)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=0, atol=1e-6), k
    ra, rb = _records(ref), _records(broken)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]  # no duplicated or missing records
    for x, y in zip(ra, rb):
        for k in ("loss", "heldout_loss"):
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), (x, y)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_two_processes_follow_one(assets, parallel):
    root, _, corpus = assets
    steps = 6
    one, two = root / f"one_{parallel}", root / f"two_{parallel}"
    p = _run(_argv(root, corpus, one, steps))
    assert p.wait(timeout=300) == 0, p.stdout.read()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "taylor_calibrate", *_argv(root, corpus, two, steps, "--train.parallel", parallel)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((two / "report.json").read_text())["processes"] == 2
    ra, rb = _records(one), _records(two)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        for k in ("loss", "heldout_loss"):
            if k in x:
                assert y[k] == pytest.approx(x[k], rel=1e-4), (k, x, y)
    a, b = _weights(one), _weights(two)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-4), k


@pytest.mark.parametrize("more, match", [
    (["--train.batch_size", "0"], "batch_size=0"),
    (["--train.train", "everything"], "train='everything'"),
    (["--train.kl_weight", "0"], "not all 0"),
    (["--train.far_weight", "-1"], "far_weight=-1"),
    (["--train.head", "full"], "head='full'"),
    (["--train.kl_chunk", "0"], "kl_chunk=0"),
    (["--train.mixer_lr", "1e-3"], "needs --train.train all"),
])
def test_bad_options_are_clear_errors(assets, more, match, capsys, tmp_path):
    root, _, corpus = assets
    assert main([*_argv(root, corpus, tmp_path / "x", 2), *more]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_not_a_hybrid_and_corrupt_checkpoint(assets, capsys, tmp_path):
    root, teacher_dir, corpus = assets
    argv = _argv(root, corpus, tmp_path / "y", 2)
    argv[argv.index("--student") + 1] = str(teacher_dir)
    assert main(argv) == 2
    assert "not a converted hybrid" in capsys.readouterr().err
    out = tmp_path / "z"
    with one_thread():
        assert main(_argv(root, corpus, out, 2, "--train.tokens", str(4 * 4 * 32))) == 0
    (out / "checkpoints" / "step_00000004" / "model.safetensors").write_bytes(b"\x00junk")
    assert main(_argv(root, corpus, out, 2, "--train.tokens", str(4 * 4 * 32))) == 2
    assert "corrupt" in capsys.readouterr().err


def test_a_teacher_of_another_vocabulary_is_refused(assets, capsys, tmp_path):
    """The KL compares the two models' logits token id by token id: a teacher with another vocabulary size, or with
    the same size but other tokens, is refused up front with the fix, before any training."""
    root, teacher_dir, corpus = assets
    bigger, other = tmp_path / "bigger", tmp_path / "other"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=VOCAB + 8)).save_pretrained(bigger)
    AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(bigger)
    shutil.copytree(teacher_dir, other)
    tiny_tokenizer(["zebra quokka axolotl " * 50]).save_pretrained(other)  # same model, another tokenizer
    for teacher, why in ((bigger, f"vocab_size {VOCAB + 8} vs {VOCAB}"), (other, "(other tokens at the same ids)")):
        argv = _argv(root, corpus, tmp_path / f"out_{teacher.name}", 2, "--teacher", str(teacher))
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "does not share the student's vocabulary" in err and why in err and "Traceback" not in err, err
        assert not (tmp_path / f"out_{teacher.name}" / "model").exists()


def test_compiled_layers_follow_the_eager_run(assets):
    """--train.compile compiles every decoder layer (torch.compile, inductor on this CPU): same losses as eager."""
    from torch._dynamo.utils import counters

    root, _, corpus = assets
    losses, graphs, heldout, reports = {}, {}, {}, {}
    for flag in ("false", "true"):
        out = root / f"compile_{flag}"
        counters.clear()
        with one_thread():
            assert main(_argv(root, corpus, out, 3, "--train.compile", flag)) == 0
        losses[flag] = [r["loss"] for r in _records(out) if "kl" in r]
        heldout[flag] = [r["heldout_loss"] for r in _records(out) if "heldout_loss" in r]
        graphs[flag] = counters["stats"]["unique_graphs"]
        reports[flag] = json.loads((out / "report.json").read_text())
    assert graphs["false"] == 0 and graphs["true"] > 0, graphs  # the flag really compiles (and off, nothing)
    assert len(heldout["true"]) >= 2 and heldout["true"] == pytest.approx(heldout["false"], rel=1e-3)
    assert all(r["first_step_s"] > 0 and r["eval_s"] > 0 for r in reports.values())  # where the wall time went
    # room for every layer variant (input requiring grad or not, train / eval, FSDP2 hooks): 2 graphs per layer of
    # teacher and student (4 + 4 here) before dynamo would fall back to eager
    assert torch._dynamo.config.recompile_limit >= 2 * 8
    assert len(losses["true"]) == 3
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weighted", [False, True])
def test_chunked_kl_equals_plain_kl_value_and_gradient(tau, dtype, weighted):
    """chunked_kl = forward_kl in value and gradient, with a ragged last chunk (14 tokens in chunks of 4), with and
    without per-token weights (--train.far_weight); in bf16 the gradients agree to bf16 rounding (both paths cast the
    fp32 gradient to the logits' dtype once)."""
    from taylor_calibrate.distill import chunked_kl, forward_kl

    g = torch.Generator().manual_seed(0)
    s0 = (3 * torch.randn(2, 7, 301, generator=g)).to(dtype)
    t = (3 * torch.randn(2, 7, 301, generator=g)).to(dtype)
    w = 2 * torch.rand(2, 7, generator=g) if weighted else None
    out = {}
    for name, fn in (("plain", forward_kl), ("chunked", lambda a, b, tau, w: chunked_kl(a, b, tau, w, chunk=4))):
        s = s0.clone().requires_grad_(True)
        loss = fn(s, t, tau, w)
        (3 * loss).backward()  # a non-unit upstream gradient
        out[name] = (loss.detach(), s.grad.float())
    (lp, gp), (lc, gc) = out["plain"], out["chunked"]
    assert lc.dtype == torch.float32 and lp.item() > 0.1
    assert lc.item() == pytest.approx(lp.item(), rel=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (gc - gp).norm() <= tol * gp.norm(), ((gc - gp).norm(), gp.norm())
    with torch.no_grad():  # no gradient wanted: the buffer is not even allocated, the value is the same
        assert chunked_kl(s0, t, tau, w, chunk=5).item() == pytest.approx(lp.item(), rel=1e-5)
    if weighted:  # the weights act: the unweighted value differs
        assert forward_kl(s0, t, tau).item() != pytest.approx(lp.item(), rel=1e-3)


def test_train_gdn_freezes_the_kept_attention_of_head_wise_layers():
    from conftest import tiny_teacher

    from taylor_calibrate import GDNConfig, convert_teacher
    from taylor_calibrate.distill import trainable_names

    hybrid = convert_teacher(tiny_teacher("llama"), [1, 2, 3], GDNConfig(), kept_groups={1: [0], 2: [1]})
    mixers, gdn = set(trainable_names(hybrid, "mixers")), set(trainable_names(hybrid, "gdn"))
    kept_attention = {n for n in mixers
                      if n.startswith(("model.layers.1.self_attn.attn.", "model.layers.2.self_attn.attn."))}
    assert kept_attention and gdn == mixers - kept_attention  # head-wise: only the GDN heads train
    assert {n for n in gdn if n.startswith("model.layers.3.")} == {n for n in mixers if n.startswith("model.layers.3.")}
    assert not any(n.startswith("model.layers.0.") for n in mixers)  # a kept layer never trains


def test_mixer_lr_gives_the_converted_mixers_their_own_rate(assets):
    """--train.train all --train.mixer_lr: one AdamW step moves each parameter by about its group's rate (Adam's
    first step is sign(grad) x lr x the schedule's factor), so the mixers move 10x what the teacher's own weights do."""
    root, _, corpus = assets
    out = root / "mixer_lr"
    with one_thread():
        assert main(_argv(root, corpus, out, 1, "--train.train", "all", "--train.lr", "1e-4", "--train.mixer_lr",
                          "1e-3", "--train.warmup", "0", "--train.grad_clip", "0")) == 0
    before = AutoModelForCausalLM.from_pretrained(root / "student").state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    moved = {k: (after[k].float() - v.float()).abs().max().item() for k, v in before.items()}
    mixer = [k for k in moved if k.startswith(tuple(f"model.layers.{i}.self_attn." for i in GDN_LAYERS))
             and k.endswith("q_proj.weight")]
    rest = [k for k in moved if k.endswith(("mlp.up_proj.weight", "self_attn.q_proj.weight")) and k not in mixer]
    assert mixer and rest
    step = moved[rest[0]]  # the schedule's factor x 1e-4 (one step: the cosine's end)
    assert step > 0 and all(moved[k] == pytest.approx(step, rel=0.05) for k in rest), {k: moved[k] for k in rest}
    assert all(moved[k] == pytest.approx(10 * step, rel=0.05) for k in mixer), {k: moved[k] for k in mixer}
