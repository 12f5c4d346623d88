"""benchmarks/distill_throughput.py end to end on a tiny random model (CPU): the full-logits and the fused loss paths,
each with a positive throughput and a loss curve, the two curves compared, and the JSON records its provenance."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_distill_throughput_tiny_runs_both_loss_paths(tmp_path):
    out = tmp_path / "thr.json"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distill_throughput.py"), "--tiny", "--device", "cpu",
                        "--kl-chunk", "48", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = {x["head"]: x for x in res["rows"]}
    assert list(rows) == ["logits", "fused"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["flops_per_token"] > 0 and not row.get("oom")
        assert len(row["loss"]) == row["steps"] == 4 and row["micro_batch"] == 2 and row["kl_chunk"] == 48
    c = res["comparison"]
    assert c["steps"] == 4 and c["max_abs_loss_diff"] < 1e-4 * abs(c["final_loss"]["logits"]) + 1e-6
    assert res["commit"] and "args" in res and "env" in res
    md = out.with_suffix(".md").read_text()
    assert "| fused | torch | sdpa | 2 x 32 | 128 |" in md and "Loss curves over 4 steps" in md
    assert all(x["loss_kernel"] == "torch" for x in res["rows"])  # auto on a CPU: the reference


def test_distill_throughput_reruns_a_path_for_the_noise_floor(tmp_path):
    """--heads logits,fused,logits: the second logits run is compared with the first (on a CPU, bitwise the same)."""
    out = tmp_path / "thr.json"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distill_throughput.py"), "--tiny", "--device", "cpu",
                        "--heads", "logits,fused,logits", "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [x["head"] for x in res["rows"]] == ["logits", "fused", "logits"]
    again = res["comparison"]["same_path_rerun"]
    assert again["head"] == "logits" and again["steps"] == 4 and again["max_abs_loss_diff"] == 0.0
    assert "The same path (logits) run again" in out.with_suffix(".md").read_text()
