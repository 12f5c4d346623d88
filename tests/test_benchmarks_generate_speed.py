"""benchmarks/generate_speed.py end to end on a tiny local teacher and its head-wise hybrid (CPU): the JSON holds every
cell's eager and compiled rows for both models with their ratios, and the compiled hybrid decodes the same tokens as
its eager generate. The compile backend is dynamo's `eager` (the graph traced, no inductor build), so the test
stays short; inductor's compile of the hybrid is tested in test_hybrid.py."""
import json
import math

import pytest

from conftest import load_benchmark, tiny_saved_hybrid

pytestmark = pytest.mark.usefixtures("single_thread")


def test_generate_speed_tiny(tmp_path):
    hybrid_dir, teacher_dir = tiny_saved_hybrid(tmp_path)
    out = tmp_path / "generate_speed.json"
    load_benchmark("generate_speed").main(["--tiny", "--device", "cpu", "--teacher", str(teacher_dir), "--hybrid",
                                           str(hybrid_dir), "--compile-backend", "eager", "--compile-mode", "default",
                                           "--fullgraph", "--out", str(out)])
    res = json.loads(out.read_text())
    ge = res["generate"]
    assert ge["gdn_layers"] == 3 and ge["headwise_layers"] == 2 and ge["compile"]["fullgraph"] is True
    assert set(ge["rows"]) == set(res["generate_hybrid_over_teacher"]) == {"16x1", "24x2"}
    for row in ge["rows"].values():
        for name in ("teacher", "hybrid"):
            for mode in ("eager", "compiled"):
                cell = row[name][mode]
                assert "error" not in cell, cell
                for key in ("prefill_s", "decode_s", "decode_tok_s", "decode_ms_per_step", "prefill_tok_s"):
                    assert math.isfinite(cell[key]), (name, mode, key)
            assert math.isfinite(row[name]["compiled_over_eager"])
        assert row["hybrid"]["compiled_tokens_equal"] and row["hybrid"]["compiled_first_mismatch"] is None
        assert set(row["hybrid_over_teacher"]) == {"eager", "compiled"}
        assert all(math.isfinite(v) for v in row["hybrid_over_teacher"].values())
    assert res["hybrid_compiled_tokens_equal"] is True
    assert "commit" in res and "## generate()" in out.with_suffix(".md").read_text()


def test_cell_beyond_the_models_positions_is_refused(tmp_path):
    hybrid_dir, teacher_dir = tiny_saved_hybrid(tmp_path)
    with pytest.raises(SystemExit, match="exceeds the models' max_position_embeddings"):
        load_benchmark("generate_speed").main(["--tiny", "--device", "cpu", "--teacher", str(teacher_dir),
                                               "--hybrid", str(hybrid_dir), "--grid", "100000x1",
                                               "--out", str(tmp_path / "g.json")])
