"""benchmarks/kd_kernel.py's tiny run on the CPU: the reference's row, its JSON with provenance."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kd_kernel_script_tiny(tmp_path):
    out = tmp_path / "kd.json"
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kd_kernel.py"), "--tiny", "--device", "cpu",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(x["vocab"], x["kernel"]) for x in res["rows"]] == [(300, "torch")]  # auto: no kernel on CPU tensors
    assert res["rows"][0]["ms_per_chunk"] > 0 and "| 300 | torch |" in r.stdout
    assert res["commit"] and "args" in res and "env" in res
