"""benchmarks/distill_throughput.py end to end on tiny shapes (CPU): plain and chunked KL rows for both shapes, each
with a positive throughput, and the JSON records its provenance."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_distill_throughput_tiny_runs_plain_and_chunked(tmp_path):
    out = tmp_path / "thr.json"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distill_throughput.py"), "--tiny", "--device", "cpu",
                        "--micro", "smollm2:2;1p5b:4", "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {(x["shape"], x["kl"], x["micro_batch"]): x for x in res["rows"]}
    assert set(rows) == {("smollm2-135m (tiny)", k, 2) for k in ("plain", "chunked")} | \
        {("qwen2.5-1.5b (tiny)", k, 4) for k in ("plain", "chunked")}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["flops_per_token"] > 0 and not row.get("oom")
    assert res["commit"] and "args" in res and "env" in res
    assert "| qwen2.5-1.5b (tiny) | chunked | 4 x 32 |" in out.with_suffix(".md").read_text()
