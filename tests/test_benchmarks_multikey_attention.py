"""benchmarks/multikey_attention.py on a tiny local teacher and a head-wise hybrid of it (CPU): the located spans
are the needles the prompt holds, every kept head is reported under its teacher number, the heads before the first
GDN layer read exactly what the teacher's do, and picks are shares in [0, 1]."""
import json

import pytest
from conftest import load_benchmark, tiny_saved_hybrid

pytestmark = pytest.mark.usefixtures("single_thread")


def test_locate_finds_the_asked_needle_and_the_distractors(tmp_path):
    from transformers import AutoTokenizer

    from taylor_calibrate.retrieval import make_samples

    mod = load_benchmark("multikey_attention")
    hybrid_dir, _ = tiny_saved_hybrid(tmp_path)
    tok = AutoTokenizer.from_pretrained(hybrid_dir)
    (sample,) = make_samples("multikey", tok, 512, 1, 0, 16)
    probe, rows, spans = mod.locate(sample, tok)
    text = tok.decode([probe.ids[i] for i in spans["asked_number"]]).replace(" ", "")
    assert text == sample.answer  # the asked needle's number, not a distractor's
    others = tok.decode([probe.ids[i] for i in spans["other_numbers"]]).replace(" ", "")
    assert all(d in others for d in sample.distractors) and sample.answer not in others
    assert rows["answer"] == [i - 1 for i in probe.answer]
    assert min(rows["question"]) > max(spans["asked_key"] + spans["other_keys"])  # the question comes last


def test_tiny_run(tmp_path):
    mod = load_benchmark("multikey_attention")
    hybrid_dir, _ = tiny_saved_hybrid(tmp_path)
    out = tmp_path / "res.json"
    mod.main(["--model", str(hybrid_dir), "--lengths", "512", "--samples", "2", "--min-mass", "0", "--device", "cpu",
              "--out", str(out)])
    res = json.loads(out.read_text())
    assert "commit" in res and "env" in res and res["args"]["samples"] == 2  # recorded with its provenance
    (cell,) = res["cells"]
    assert cell["probes"] == 2
    assert set(cell["teacher"]) == {f"{i}.{h}" for i in range(4) for h in range(4)}
    assert set(cell["hybrid"]) == {"0.0", "0.1", "0.2", "0.3", "1.2", "1.3", "2.0", "2.1"}
    for name, h in cell["hybrid"].items():
        t = cell["teacher"][name]
        assert 0 <= h["pick"] <= 1 and 0 <= h["key_pick"] <= 1
        assert sum(h["answer"].values()) <= 1 + 1e-5
        if name.split(".")[0] in ("0", "1"):  # layer 0 is the teacher's; layer 1's kept part reads its output
            assert h["answer"] == pytest.approx(t["answer"], abs=1e-5)
    assert any(abs(cell["hybrid"][n]["answer"]["asked_number"] - cell["teacher"][n]["answer"]["asked_number"]) > 1e-6
               for n in ("2.0", "2.1"))
    assert "| 512 | 0.0 |" in out.with_suffix(".md").read_text()
