"""`taylor-calibrate tradeoff` end to end on a tiny local Llama teacher (CPU): a layer and a head-wise row per budget,
NIAH and the teacher-forced score beside the teacher's, end-to-end phases, the results JSON with its provenance,
table, plot."""
import json

import pytest
from conftest import tiny_local_teacher

from taylor_calibrate.cli import main
from taylor_calibrate.config import AlignArgs

pytestmark = pytest.mark.usefixtures("single_thread")


def _convert_flags(corpus):
    return ["--data.source", str(corpus), "--data.seq_len", "64", "--data.calib_seqs", "4", "--data.eval_seqs", "2",
            "--phase2.steps", "2", "--probe_samples", "1", "--device", "cpu"]


def test_tiny_run(tmp_path):
    teacher, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=1024)
    out = tmp_path / "tradeoff"
    assert main(["tradeoff", "--teacher", str(teacher), "--budgets", "[0.3]", "--policies", "[uniform,heads]",
                 "--niah_tasks", "[passkey]", "--niah_lengths", "[512]", "--niah_samples", "1",
                 "--logprob_length", "512", "--out", str(out), *_convert_flags(corpus)]) == 0
    res = json.loads((out / "tradeoff.json").read_text())
    assert [r["policy"] for r in res["rows"]] == ["uniform", "heads"]
    assert all(r["kv_fraction"] <= 0.3 and r["niah"]["passkey"]["512"] is not None for r in res["rows"])
    assert res["rows"][1]["granularity"] == "head" and res["teacher"]["niah"]["passkey"]["512"] is not None
    for name in ("teacher", *(f"row{i}" for i in range(len(res["rows"])))):  # every reply kept for inspection
        assert len((out / "answers" / f"{name}.jsonl").read_text().splitlines()) == 1
    assert {"commit", "dirty", "args", "env", "command"} <= set(res)
    assert res["teacher"]["niah_by_distance"]["passkey"] and all(r["niah_by_distance"] for r in res["rows"])
    md = (out / "tradeoff.md").read_text()
    assert "by how far back the asked needle sat" in md and "| passkey <=512 |" in md
    assert (out / "tradeoff.png").exists()
    # a rerun into the same --out is allowed (an earlier tradeoff output); a foreign non-empty dir is not
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x.txt").write_text("mine")
    assert main(["tradeoff", "--teacher", str(teacher), "--out", str(foreign), *_convert_flags(corpus)]) == 2


def test_end_to_end_phase_adds_a_distilled_row(tmp_path):
    teacher, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=1024)
    out = tmp_path / "tradeoff"
    phase = f"--data.source {corpus} --data.seq_len 128 --data.eval_seqs 2 --train.batch_size 4 --train.lr 1e-3"
    assert main(["tradeoff", "--teacher", str(teacher), "--budgets", "[0.3]", "--policies", "[heads]",
                 "--niah_tasks", "[passkey]", "--niah_lengths", "[512]", "--niah_samples", "1",
                 "--logprob_length", "512", "--out", str(out), *_convert_flags(corpus),
                 "--distill_tokens", "2048", "--distill", json.dumps([phase + " --train.repeat_spans 0.5", phase])]) == 0
    res = json.loads((out / "tradeoff.json").read_text())
    zero, e2e, plain = res["rows"]
    assert zero["distill_tokens"] == 0 and e2e["distill_tokens"] == 2048 and e2e["distill_seq_len"] == 128
    assert e2e["kv_fraction"] == zero["kv_fraction"] and e2e["distill_args"]["train"]["repeat_spans"] == 0.5
    assert e2e["ppl"] != zero["ppl"] and len(e2e["distill"]["heldout_loss"]) >= 2  # trained, measured on the same text
    assert plain["distill_args"]["train"]["repeat_spans"] == 0 and plain["ppl"] != e2e["ppl"]  # each from zero-shot
    assert e2e["niah"]["passkey"]["512"] is not None
    md = (out / "tradeoff.md").read_text()
    # named by its row length and --train flags
    assert "| heads + end-to-end (128-token rows, --train.batch_size 4 --train.lr 1e-3 --train.repeat_spans 0.5) |" in md
    assert "| heads + end-to-end (128-token rows, --train.batch_size 4 --train.lr 1e-3) | head |" in md
    assert not zero["phase2_kept_attention"] and zero["phase2_far_weight"] == AlignArgs.far_weight  # the default


def test_row_label_names_what_changes_the_result():
    """A row is named by what departs from the defaults; flags that only change how a run is carried out
    (micro-batches, checkpoints, compile) stay out of its name."""
    from taylor_calibrate.experiments.tradeoff import label
    row = {"policy": "heads", "seed": 1, "phase2_far_weight": AlignArgs.far_weight, "distill_tokens": 10,
           "distill_flags": "--data.seq_len 4096 --train.micro_batch_size 8 --train.far_weight 16 --train.compile=false"}
    assert label(row) == "heads (seed 1) + end-to-end (--train.far_weight 16)"
    assert label({**row, "distill_flags": "--train.micro_batch_size=8"}).endswith("end-to-end (defaults)")
    assert label({**row, "distill_seq_len": 8192}) == "heads (seed 1) + end-to-end (8192-token rows, --train.far_weight 16)"
    assert label({**row, "distill_seq_len": 4096, "distill_flags": ""}).endswith("end-to-end (4096-token rows)")
    assert label({**row, "distill_tokens": 0, "seed": 0, "phase2_far_weight": 4.0}) == "heads + far_weight 4"
    old = {k: v for k, v in row.items() if k != "phase2_far_weight"}  # recorded before the option: it was off
    assert label({**old, "distill_tokens": 0}) == "heads (seed 1) + far_weight 0"


@pytest.mark.parametrize("command", ["tradeoff", "recovery"])
def test_too_short_niah_length_fails_before_the_teacher_loads(tmp_path, monkeypatch, command, capsys):
    teacher, corpus = tiny_local_teacher(tmp_path)
    module = f"taylor_calibrate.experiments.{command}"

    def never(*a, **k):
        raise AssertionError("the teacher was loaded before the NIAH lengths were checked")

    monkeypatch.setattr(f"{module}.load_teacher", never)
    assert main([command, "--teacher", str(teacher), "--niah_lengths", "[80]", "--out", str(tmp_path / "o"),
                 *_convert_flags(corpus)]) != 0
    assert "too short" in capsys.readouterr().err and not (tmp_path / "o").exists()
