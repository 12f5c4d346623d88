"""benchmarks/kept_attention.py on a tiny local teacher and a head-wise hybrid of it (CPU): every kept head is listed
under its teacher number, the heads before the first GDN layer keep the teacher's needle mass exactly, one past a
GDN part does not, and the kept heads hold part of the teacher's needle mass (coverage)."""
import json

import pytest
from conftest import load_benchmark, tiny_saved_hybrid

pytestmark = pytest.mark.usefixtures("single_thread")


def test_tiny_run(tmp_path):
    mod = load_benchmark("kept_attention")
    hybrid_dir, _ = tiny_saved_hybrid(tmp_path)
    out = tmp_path / "res.json"
    mod.main(["--model", str(hybrid_dir), "--tasks", "single", "--lengths", "512", "--samples", "2",
              "--min-mass", "0", "--device", "cpu", "--out", str(out)])
    res = json.loads(out.read_text())
    assert "commit" in res and "env" in res and res["args"]["samples"] == 2  # recorded with its provenance
    (cell,) = res["cells"]
    heads = {(x["layer"], x["head"]): x for x in cell["heads"]}
    assert set(heads) == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 0), (2, 1)}
    for (layer, _), x in heads.items():
        if layer < 2:  # layer 0 is the teacher's; layer 1's kept part (heads 2-3: its second group) reads its output
            assert x["hybrid"] == pytest.approx(x["teacher"], abs=1e-5)
    assert any(abs(x["hybrid"] - x["teacher"]) > 1e-4 for (layer, _), x in heads.items() if layer == 2)
    # coverage: the kept heads' share of the teacher's needle mass over all 4 x 4 heads (min-mass 0 lists them all)
    assert 0 < cell["coverage"] < 1
    kept_mass = sum(x["teacher"] for x in heads.values())
    assert kept_mass / cell["coverage"] > kept_mass + 1e-6  # the converted heads held some of it
    assert "| single | 512 |" in out.with_suffix(".md").read_text()
