"""benchmarks/retrieval_tradeoff.py end to end on a tiny local Llama teacher (CPU): a layer and a head-wise row per
budget, NIAH and the teacher-forced score beside the teacher's, the results JSON with its provenance, table, plot."""
import json

import pytest
from conftest import load_benchmark, tiny_local_teacher

pytestmark = pytest.mark.usefixtures("single_thread")


def test_tiny_run(tmp_path):
    mod = load_benchmark("retrieval_tradeoff")
    teacher, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=1024)
    out = tmp_path / "retrieval.json"
    mod.main(["--teacher", str(teacher), "--budgets", "0.3", "--policies", "uniform", "heads", "--tasks", "passkey",
              "--lengths", "512", "--samples", "1", "--logprob-length", "512", "--device", "cpu", "--out", str(out),
              "--convert", f"--data.source {corpus} --data.seq_len 64 --data.calib_seqs 4 --data.eval_seqs 2 "
                           "--phase2.steps 2 --probe_samples 1"])
    res = json.loads(out.read_text())
    assert [r["policy"] for r in res["rows"]] == ["uniform", "heads"]
    assert all(r["kv_fraction"] <= 0.3 and r["niah"]["passkey"]["512"] is not None for r in res["rows"])
    assert res["rows"][1]["granularity"] == "head" and res["teacher"]["niah"]["passkey"]["512"] is not None
    assert {"commit", "dirty", "args", "env"} <= set(res)
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").exists()


def test_end_to_end_phase_adds_a_distilled_row(tmp_path):
    mod = load_benchmark("retrieval_tradeoff")
    teacher, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=1024)
    out = tmp_path / "retrieval.json"
    mod.main(["--teacher", str(teacher), "--budgets", "0.3", "--policies", "heads", "--tasks", "passkey",
              "--lengths", "512", "--samples", "1", "--logprob-length", "512", "--device", "cpu", "--out", str(out),
              "--convert", f"--data.source {corpus} --data.seq_len 64 --data.calib_seqs 4 --data.eval_seqs 2 "
                           "--phase2.steps 2 --probe_samples 1",
              "--distill-tokens", "2048", "--distill", f"--data.source {corpus} --data.seq_len 128 --data.eval_seqs 2 "
                                                       "--train.batch_size 4 --train.repeat_spans 0.5 --train.lr 1e-3",
              f"--data.source {corpus} --data.seq_len 128 --data.eval_seqs 2 --train.batch_size 4 --train.lr 1e-3"])
    res = json.loads(out.read_text())
    zero, e2e, plain = res["rows"]
    assert plain["distill_args"]["train"]["repeat_spans"] == 0 and plain["ppl"] != e2e["ppl"]  # each from zero-shot
    assert zero["distill_tokens"] == 0 and e2e["distill_tokens"] == 2048 and e2e["distill_seq_len"] == 128
    assert e2e["kv_fraction"] == zero["kv_fraction"] and e2e["distill_args"]["train"]["repeat_spans"] == 0.5
    assert e2e["ppl"] != zero["ppl"] and len(e2e["distill"]["heldout_loss"]) >= 2  # trained, measured on the same text
    assert e2e["niah"]["passkey"]["512"] is not None and "| heads | head |" in out.with_suffix(".md").read_text()
