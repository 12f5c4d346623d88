"""Teacher agreement, the lm-eval adapter on an in-memory model, and `eval` end to end with --niah/--agreement."""
import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from taylor_calibrate.cli import main
from taylor_calibrate.config import GDNConfig
from taylor_calibrate.evaluate import agreement, import_lm_eval, lm_eval_tasks, nll_sum
from taylor_calibrate.checkpoint import save_hybrid
from taylor_calibrate.model.hybrid import convert_teacher
from conftest import tiny_teacher

ASSETS = str(Path(__file__).parent / "assets")


@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_nll_sum_in_chunks_equals_the_plain_cross_entropy(chunk):
    """perplexity's chunked fp32 NLL equals one cross entropy over every position's fp32 logits, from bf16 logits."""
    torch.manual_seed(0)
    logits, ids = torch.randn(3, 12, 50).to(torch.bfloat16), torch.randint(0, 50, (3, 12))
    plain = F.cross_entropy(logits[:, :-1].float().reshape(-1, 50), ids[:, 1:].reshape(-1), reduction="sum")
    assert nll_sum(logits, ids, chunk=chunk) == pytest.approx(plain.item(), rel=1e-5)


def test_agreement_of_a_model_with_itself_and_a_perturbed_copy(single_thread):
    model = tiny_teacher("qwen3")
    tokens = torch.randint(0, 97, (3, 20))
    same = agreement(model, model, tokens, batch_size=2)
    assert same["kl"] == pytest.approx(0.0, abs=1e-6) and same["top1"] == 1.0 and same["tokens"] == 60
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.add_(0.5 * torch.randn_like(other.lm_head.weight))
    got = agreement(other, model, tokens, batch_size=2, chunk=7)  # chunks that straddle rows
    p = F.log_softmax(model(tokens).logits, -1)  # reference: the whole (N, T, V) at once
    q = F.log_softmax(other(tokens).logits, -1)
    assert got["kl"] > 1e-3
    assert got["kl"] == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-4)
    assert got["top1"] == pytest.approx((p.argmax(-1) == q.argmax(-1)).float().mean().item())
    assert got["top1"] < 1.0


def test_lm_eval_adapter_on_a_local_task(smollm2_tokenizer, single_thread):
    hybrid = convert_teacher(tiny_teacher("llama", vocab_size=len(smollm2_tokenizer)), [1, 2, 3], GDNConfig())
    out = lm_eval_tasks(hybrid, smollm2_tokenizer, ["tiny_mc"], include_path=ASSETS, limit=5, batch_size=4)
    assert set(out) == {"tiny_mc"}
    assert 0.0 <= out["tiny_mc"]["acc,none"] <= 1.0 and out["tiny_mc"]["samples"] == 5
    with pytest.raises(ValueError, match="not found"):
        lm_eval_tasks(hybrid, smollm2_tokenizer, ["no_such_task"], include_path=ASSETS)


def test_missing_lm_eval_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # makes `import lm_eval` fail
    with pytest.raises(ImportError, match=r'pip install "taylor-calibrate\[eval\]"'):
        import_lm_eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, smollm2_tokenizer):
    """A tiny random teacher and its copy-only hybrid, saved with the real tokenizer."""
    root = tmp_path_factory.mktemp("tiny")
    teacher = tiny_teacher("llama", vocab_size=len(smollm2_tokenizer), max_position_embeddings=512)
    teacher.save_pretrained(root / "teacher")
    smollm2_tokenizer.save_pretrained(root / "teacher")
    save_hybrid(convert_teacher(teacher, [1, 2, 3], GDNConfig()), smollm2_tokenizer, root / "hybrid")
    return root


def test_eval_cli_niah_agreement_lm_eval(saved, tmp_path, capsys, single_thread):
    out = tmp_path / "ev"
    argv = ["eval", "--model", str(saved / "hybrid"), "--teacher", str(saved / "teacher"), "--out", str(out),
            "--device", "cpu", "--data.seq_len", "64", "--data.eval_seqs", "2",
            "--niah", "true", "--niah_lengths", "[256, 1024]", "--niah_samples", "1", "--agreement", "true",
            "--lm_eval_tasks", "[tiny_mc]", "--lm_eval_include", ASSETS, "--lm_eval_limit", "4"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    for key in ("niah", "teacher_niah"):  # 1024 > max_position_embeddings = 512: skipped, null
        assert report[key] == {t: {"256": 0.0, "1024": None} for t in ("single", "multikey", "passkey")}
    answers = [json.loads(l) for l in (out / "niah_answers.jsonl").read_text().splitlines()]
    assert [a["model"] for a in answers] == ["model"] * 3 + ["teacher"] * 3  # one prompt per task at 256 tokens
    assert set(report["niah_distractor"]) == {"model", "teacher"} and "multikey" in report["niah_distractor"]["model"]
    assert set(report["niah_no_number"]["model"]) == {"single", "multikey", "passkey"}
    assert set(report["niah_by_distance"]["model"]) == {"single", "multikey", "passkey"} == \
        set(report["niah_by_distance"]["teacher"])
    a = report["agreement"]
    assert a["tokens"] == 2 * 64 and a["kl"] > 0 and 0 <= a["top1"] <= 1
    assert report["lm_eval"]["tiny_mc"]["samples"] == 4 and 0 <= report["lm_eval"]["tiny_mc"]["acc,none"] <= 1
    assert {"ppl_s", "agreement_s", "niah_s", "teacher_niah_s", "lm_eval_s"} == set(report["stage_s"])
    printed = capsys.readouterr().out
    assert "NIAH accuracy" in printed and "passkey (teacher)" in printed and "top-1 agreement" in printed


@pytest.mark.parametrize("extra, match", [
    (["--agreement", "true"], "pass --teacher"),
    (["--niah_tasks", "[haystack]"], "niah_tasks"),
    (["--lm_eval_include", "/nope"], "not a directory"),
])
def test_eval_cli_bad_options_are_clear_errors(extra, match, saved, capsys):
    assert main(["eval", "--model", str(saved / "hybrid"), "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and match in err and "Traceback" not in err, err
