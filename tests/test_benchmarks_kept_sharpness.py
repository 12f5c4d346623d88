"""benchmarks/kept_sharpness.py: scaling the queries multiplies every softmax head's attention logits by the factor on
each supported architecture (q/k-norm and Gemma's 1 + weight norm included); the benchmark restores the model between
factors, records its provenance, and --save writes a hybrid whose kept queries alone are scaled."""
import json

import pytest
import torch
from conftest import load_benchmark, tiny_saved_hybrid, tiny_teacher
from transformers import AutoTokenizer

from taylor_calibrate.checkpoint import load_model
from taylor_calibrate.retrieval import answer_scores, eval_probes

pytestmark = pytest.mark.usefixtures("single_thread")


def _attentions(model, ids):
    with torch.no_grad():
        return model(ids, output_attentions=True).attentions


def test_scale_multiplies_logits(arch):
    mod = load_benchmark("kept_sharpness")
    model = tiny_teacher(arch)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    before = _attentions(model, ids)
    assert mod.scale_queries(model, 2.0) > 0
    after = _attentions(model, ids)
    want = before[0].double() ** 2  # the first layer reads the same input: softmax(2 x logits) = p^2, renormalised
    torch.testing.assert_close(after[0].double(), want / want.sum(-1, keepdim=True), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(after[-1], before[-1])  # every layer's queries scaled, not only the first


def test_tiny_run(tmp_path):
    mod = load_benchmark("kept_sharpness")
    hybrid_dir, teacher_dir = tiny_saved_hybrid(tmp_path)
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    out = tmp_path / "res.json"
    res = mod.main(["--model", str(hybrid_dir), "--scales", "1,3", "--tasks", "single", "--lengths", "512",
                    "--samples", "2", "--device", "cpu", "--save", str(tmp_path / "sharp"), "--save-scale", "3",
                    "--out", str(out)])
    saved = json.loads(out.read_text())
    assert "commit" in saved and "env" in saved and saved["args"]["scales"] == "1,3"  # recorded with its provenance
    base, _ = load_model(hybrid_dir)
    probes = eval_probes(tok, 512, samples=2, tasks=("single",))
    one, three = res["hybrid"]
    assert one["logprob"] == pytest.approx(answer_scores(base, probes)["logprob"], abs=1e-5)  # factor 1: unchanged
    assert three["logprob"] != pytest.approx(one["logprob"], abs=1e-4)
    assert [r["scale"] for r in res["teacher_rows"]] == [1.0, 3.0]
    sharp, _ = load_model(tmp_path / "sharp")
    queries = {id(t) for t, _ in mod.query_weights(base)}
    b, s = dict(base.named_parameters()), dict(sharp.named_parameters())
    scaled = {n for n, w in b.items() if id(w) in queries}
    # the softmax q_proj of layer 0, the kept heads' of layers 1-2; the GDN mixers' q_proj are not among them
    assert len(scaled) == 3 and all(n.endswith("q_proj.weight") for n in scaled)
    assert sum(n.endswith("q_proj.weight") for n in b) > 3
    for name, w in b.items():  # tripled where scaled, everything else as saved
        torch.testing.assert_close(s[name], w * 3 if name in scaled else w)


def test_crossing():
    mod = load_benchmark("kept_sharpness")
    grid = (1.0, 2.0, 3.0)
    curve = torch.tensor([3.0, 2.0, 1.0])
    assert mod.crossing(grid, curve, 2.5) == pytest.approx(1.5)
    assert mod.crossing(grid, curve, 2.0) == pytest.approx(2.0)
    assert mod.crossing(grid, curve, 4.0) == 1.0 and mod.crossing(grid, curve, 0.5) == 3.0  # outside: nearest end


def test_match_entropy(tmp_path):
    mod = load_benchmark("kept_sharpness")
    hybrid_dir, teacher_dir = tiny_saved_hybrid(tmp_path)
    res = mod.main(["--model", str(hybrid_dir), "--scales", "1", "--tasks", "single", "--lengths", "512",
                    "--samples", "1", "--device", "cpu", "--match-entropy", "2", "--fit-len", "64",
                    "--data", str(tmp_path / "corpus"), "--save", str(tmp_path / "matched")])
    factors = {int(i): f for i, f in res["matched_factors"].items()}
    assert sorted(factors) == [0, 1, 2] and [len(f) for f in factors.values()] == [4, 2, 2]  # kept heads only
    # layers 0 and 1 read the teacher's own input (layer 0 is softmax): nothing to match; layer 2 reads a GDN output
    assert factors[0] + factors[1] == pytest.approx([1.0] * 6, abs=1e-4)
    assert any(abs(f - 1) > 1e-2 for f in factors[2])
    base, _ = load_model(hybrid_dir)
    saved, _ = load_model(tmp_path / "matched")
    for i in (1, 2):  # each kept head's 16 query rows scaled by its own factor
        w, s = base.model.layers[i].self_attn, saved.model.layers[i].self_attn
        (bq,) = [m.q_proj.weight for m in w.modules() if hasattr(m, "q_proj") and hasattr(m, "scaling")]
        (sq,) = [m.q_proj.weight for m in s.modules() if hasattr(m, "q_proj") and hasattr(m, "scaling")]
        for j, f in enumerate(factors[i]):
            torch.testing.assert_close(sq[16 * j:16 * (j + 1)], bq[16 * j:16 * (j + 1)] * f)


def test_per_head_needs_a_projection_per_head():
    mod = load_benchmark("kept_sharpness")
    model = tiny_teacher("qwen3")
    model.config.gdn_layers = []
    with pytest.raises(ValueError, match="q_norm shared by its heads"):
        mod.scale_heads(model, {0: [1.1, 1.0, 1.0, 1.0]})


@pytest.mark.parametrize("flags, msg", [(["--save", "x"], "--save needs"), (["--save-scale", "2"], "needs --save DIR"),
                                        (["--save", "x", "--save-scale", "2", "--match-entropy", "2"], "pass one")])
def test_bad_flags(flags, msg):
    mod = load_benchmark("kept_sharpness")
    with pytest.raises(SystemExit, match=msg):
        mod.main(["--model", "unused", *flags])
