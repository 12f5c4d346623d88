"""The `ablate` stage end to end on a tiny local teacher (random llama + an offline byte-level BPE tokenizer) and a
small text corpus: every init x policy row, the JSON schema and the markdown table."""
import json
import math

import pytest
from conftest import one_thread, tiny_local_teacher

from taylor_calibrate.experiments.ablate import markdown_table, parse_init, run_ablate
from taylor_calibrate.config import AblateArgs, AlignArgs, DataArgs

INITS = ["copy", "align", "taylor", "taylor+align"]
POLICIES = ["uniform", "bypass", "greedy", "kl"]


@pytest.fixture(scope="module")
def ablated(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablate")
    teacher_dir, corpus = tiny_local_teacher(root)
    args = AblateArgs(
        teacher=str(teacher_dir), out=str(root / "out"), inits=list(INITS), policies=list(POLICIES), keep_every=2,
        profile="quick", data=DataArgs(source=str(corpus), seq_len=32, calib_seqs=4, eval_seqs=2),
        phase2=AlignArgs(steps=3, batch_size=2), device="cpu", backend="torch", eval_batch_size=2,
        command="pytest tests/test_ablate.py",
    )
    with one_thread():
        return args, run_ablate(args), root / "out"


def test_result_schema(ablated):
    args, result, _ = ablated
    for key in ("teacher", "teacher_ppl", "kept_fraction", "eval_tokens", "rows", "command"):
        assert key in result, key
    assert result["teacher"] == args.teacher
    assert math.isfinite(result["teacher_ppl"]) and result["teacher_ppl"] > 1
    assert result["eval_tokens"] == 2 * 31  # eval_seqs x (seq_len - 1) predicted tokens
    assert result["kept_fraction"] == 0.5  # ceil(4 / 2) of 4 layers
    assert result["command"] == "pytest tests/test_ablate.py"


def test_one_row_per_init_and_policy(ablated):
    _, result, _ = ablated
    rows = result["rows"]
    assert [(r["policy"], r["init"]) for r in rows] == [(p, i) for p in POLICIES for i in INITS]
    for r in rows:
        assert set(r) >= {"policy", "init", "phase2", "ppl", "kept_layers"}
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1, r
        assert r["phase2"] == r["init"].endswith("align"), r
        assert len(r["kept_layers"]) == 2 and r["kept_layers"] == sorted(r["kept_layers"]), r
    kept = {p: {tuple(r["kept_layers"]) for r in rows if r["policy"] == p} for p in POLICIES}
    assert all(len(k) == 1 for k in kept.values()), "every init of a policy converts the same layers"
    assert kept["uniform"] == {(0, 2)}
    for p in ("bypass", "greedy", "kl"):
        assert len(result["policy_scores"][p]) == 4


def test_rows_differ_between_inits(ablated):
    """Each init really builds its own mixers: no two inits give the same perplexity on a policy."""
    _, result, _ = ablated
    for p in POLICIES:
        ppls = [r["ppl"] for r in result["rows"] if r["policy"] == p]
        assert len(set(ppls)) == len(INITS), (p, ppls)


def test_far_weight_changes_the_aligned_rows_only(ablated, tmp_path):
    """--phase2.far_weight reaches ablate's phase 2 as it reaches convert's: the aligned row moves, the unaligned not."""
    import dataclasses

    args, result, _ = ablated
    far = dataclasses.replace(args, out=str(tmp_path / "far"), inits=["taylor", "taylor+align"],
                              policies=["uniform"], phase2=dataclasses.replace(args.phase2, far_weight=4.0))
    with one_thread():
        rows = {r["init"]: r["ppl"] for r in run_ablate(far)["rows"]}
    base = {r["init"]: r["ppl"] for r in result["rows"] if r["policy"] == "uniform"}
    assert rows["taylor"] == pytest.approx(base["taylor"], rel=1e-6)
    assert rows["taylor+align"] != pytest.approx(base["taylor+align"], rel=1e-6)


def test_files_written(ablated):
    _, result, out = ablated
    saved = json.loads((out / "ablation.json").read_text())
    assert saved["rows"] == result["rows"] and saved["teacher_ppl"] == result["teacher_ppl"]
    md = (out / "ablation.md").read_text()
    assert md == markdown_table(result)
    for name in INITS + POLICIES:
        assert f" {name} |" in md, name
    assert "pytest tests/test_ablate.py" in md


# ----------------------------------------------------------------------------- init specs


@pytest.mark.parametrize("spec, parsed", [
    ("copy", ("copy", False)), ("taylor", ("taylor", False)), ("paper+align", ("paper", True)),
    ("zero_gate+align", ("zero_gate", True)), ("align", ("copy", True)),
])
def test_parse_init(spec, parsed):
    assert parse_init(spec) == parsed


@pytest.mark.parametrize("spec", ["taylor+foo", "taylor+align+align", "paper+aligned"])
def test_parse_init_bad_suffix(spec):
    with pytest.raises(ValueError, match=f"bad init spec '{spec.replace('+', '[+]')}'"):
        parse_init(spec)


@pytest.mark.parametrize("spec", ["magic", "Taylor", "", "+align", "magic+align", "copy+", "align+align"])
def test_parse_init_bad_method(spec):
    with pytest.raises(ValueError):
        parse_init(spec)


@pytest.mark.parametrize("kw", [{"inits": ["taylor+foo"]}, {"policies": ["uniform", "greedyish"]}])
def test_bad_ablate_options_fail_before_any_work(kw, monkeypatch):
    import taylor_calibrate.experiments.ablate as ablate

    def no_teacher(*args, **kwargs):
        raise AssertionError("run_ablate loaded the teacher before validating its options")

    monkeypatch.setattr(ablate, "load_teacher", no_teacher)
    with pytest.raises(ValueError):
        run_ablate(AblateArgs(teacher="unused", device="cpu", **kw))


def test_choose_layers_honours_the_kv_budget():
    from types import SimpleNamespace

    from taylor_calibrate.experiments.ablate import choose_layers

    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=30))
    kept, _ = choose_layers(model, ["uniform"], {}, None, SimpleNamespace(keep_every=4, kv_budget=0.1))
    assert len(kept["uniform"]) == 3  # floor(0.1 x 30), not ceil(30 / 4)
    kept, _ = choose_layers(model, ["uniform"], {}, None, SimpleNamespace(keep_every=4, kv_budget=None))
    assert len(kept["uniform"]) == 8
