"""benchmarks/decode_qwen3_5.py end to end on tiny shapes (CPU): the export runs in transformers' class and gives our
logits, every model decodes through the static cache, the JSON and its table are written."""
import json
import math

import pytest
from conftest import load_benchmark

pytestmark = pytest.mark.usefixtures("single_thread")

def test_tiny_run(tmp_path):
    mod = load_benchmark("decode_qwen3_5")
    out = tmp_path / "decode.json"
    mod.main(["--tiny", "--device", "cpu", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["models"] == {"teacher": "Qwen2ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "ours": "HybridForCausalLM"}
    assert res["export_logits_rel_err"] < 1e-5 and "commit" in res and "dirty" in res
    assert all(e["static"] < 1e-4 for e in res["static_decode_rel_err"].values())
    for cell, rows in res["rows"].items():
        for name in ("teacher", "qwen3_5", "ours"):
            assert math.isfinite(rows[name]["decode_tok_s"]) and rows[name]["min_bytes_per_step"] > 0, (cell, name)
    assert (tmp_path / "decode.md").read_text().startswith("| context x batch")
