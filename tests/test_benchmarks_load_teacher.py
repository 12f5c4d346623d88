"""benchmarks/load_teacher.py on the embedded teacher, one load of each kind: one reader against three, none from the
teacher cache, the same teacher every way, a JSON with provenance."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import load_teacher  # noqa: E402


def test_load_teacher_script_counts_readers_and_compares_the_loads(tmp_path, capsys):
    out = tmp_path / "load.json"
    load_teacher.main(["--reps", "1", "--out", str(out)])
    res = json.loads(out.read_text())
    (row,) = res["rows"]
    assert row["readers_built"] == {"plain": 3, "shared": 1, "first": 1, "cached": 0}
    assert row["same_weights_and_ids"] is True
    assert row["median_s"]["cached"] > 0 and res["commit"] and "env" in res
    assert "| smollm2-135m |" in capsys.readouterr().out
