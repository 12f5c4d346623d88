"""benchmarks/target_qwen3_5.py end to end on a tiny local Llama teacher (CPU): both conversions, the export, both
evaluations; the export's held-out perplexity is the target conversion's, and the table is written."""
import json

import pytest

from conftest import load_benchmark, tiny_local_teacher

pytestmark = pytest.mark.usefixtures("single_thread")

def test_tiny_run(tmp_path):
    mod = load_benchmark("target_qwen3_5")
    teacher, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=512)  # NIAH's prompts need 393 tokens
    out = tmp_path / "res.json"
    mod.main(["--teacher", str(teacher), "--work", str(tmp_path / "w"), "--niah-lengths", "512", "--niah-samples", "1",
              "--out", str(out), "--convert-args", "--phase2.steps 2 --phase2.batch_size 2 --data.calib_seqs 4", "--",
              "--device", "cpu", "--backend", "torch", "--data.source", str(corpus), "--data.seq_len", "32",
              "--data.eval_seqs", "2"])
    res = json.loads(out.read_text())
    assert res["served_ppl"] == pytest.approx(res["target_convert_ppl"], rel=1e-4)
    assert res["teacher_ppl"] and res["ours_ppl"] and set(res["niah"]) == {"teacher", "ours", "served"}
    assert "| ours (HybridForCausalLM) |" in out.with_suffix(".md").read_text()
    ours, target = (json.loads((tmp_path / "w" / d / "report.json").read_text()) for d in ("ours", "target"))
    assert ours["policy"] == target["policy"] == "uniform" and ours["kept_layers"] == target["kept_layers"]
