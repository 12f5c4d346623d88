"""The `recovery` experiment on a tiny local teacher: the committed JSON schema, curves, tokens-to-match, resume."""
import json
import math

import pytest
from conftest import one_thread, tiny_local_teacher

from taylor_calibrate.config import AlignArgs, DataArgs, RecoveryArgs, TrainArgs
from taylor_calibrate.recovery import run_recovery, tokens_to_match, tokens_to_reach


def test_tokens_to_reach_interpolates():
    assert tokens_to_reach([0, 100, 200], [3.0, 2.0, 1.0], 1.5) == pytest.approx(150)
    assert tokens_to_reach([0, 100], [3.0, 2.0], 3.5) == 0  # already there at the start
    assert tokens_to_reach([0, 100], [3.0, 2.0], 1.0) is None  # never


def test_tokens_to_match_is_n_over_n_prime():
    copy = {"tokens": [0, 100, 200], "heldout_loss": [5.0, 3.0, 2.0]}
    ours = {"tokens": [0, 100, 200], "heldout_loss": [2.5, 1.5, 1.0]}
    assert tokens_to_match(copy, ours) == pytest.approx(200 / 50)
    assert tokens_to_match(ours, copy) is None
    assert tokens_to_match(copy, {"tokens": [0, 10], "heldout_loss": [1.0, 0.9]}) == math.inf


@pytest.fixture(scope="module")
def recovered(tmp_path_factory):
    root = tmp_path_factory.mktemp("recovery")
    teacher_dir, corpus = tiny_local_teacher(root, max_position_embeddings=1024)
    args = RecoveryArgs(
        teacher=str(teacher_dir), out=str(root / "out"), keep_every=2, profile="quick", device="cpu", backend="torch",
        data=DataArgs(source=str(corpus), seq_len=32, calib_seqs=4, eval_seqs=2), eval_batch_size=2,
        phase2=AlignArgs(steps=3, batch_size=2), train=TrainArgs(tokens=6 * 2 * 32, batch_size=2, lr=1e-2, eval_every=2),
        niah_tasks=["single", "passkey"], niah_lengths=[512], niah_samples=1, niah_points=3,
        command="pytest tests/test_recovery.py",
    )
    with one_thread():
        return args, run_recovery(args), root / "out"


def test_result_schema_and_files(recovered):
    args, result, out = recovered
    assert result["teacher"] == args.teacher and result["budget_tokens"] == 6 * 2 * 32
    assert result["command"] == "pytest tests/test_recovery.py" and result["throughput_tokens_per_s"] > 0
    assert set(result["policies"]) == {"uniform", "bypass", "greedy"}
    for policy, runs in result["policies"].items():
        inits = {"copy", "align", "taylor+align"} | ({"paper+align"} if policy == "uniform" else set())
        assert inits <= set(runs)
        for init in inits:
            r = runs[init]
            assert r["tokens"] == [0, 128, 256, 384] and len(r["heldout_loss"]) == 4
            assert all(math.isfinite(x) for x in r["heldout_loss"])
            assert set(r["niah"]) == {"start", "end"} and set(r["niah"]["start"]) == {"single", "passkey"}
            assert [c["tokens"] for c in r["niah_curve"]] == [0, 192, 384]  # NIAH at 3 points along the run
            assert r["niah"]["end"] == r["niah_curve"][-1]["scores"]
        assert "tokens_to_match" in runs and "tokens_to_match_phase2only" in runs
        want = tokens_to_match(runs["copy"], runs["taylor+align"])
        assert runs["tokens_to_match"] == want or (want is None and runs["tokens_to_match"] is None)
    assert (out / "recovery_curves.png").stat().st_size > 10_000
    md = (out / "recovery.md").read_text()
    assert "tokens to match" in md and "NIAH accuracy along each run" in md
    assert result["complete"] is True and result["train_windows"] > 0
    assert json.loads((out / "recovery.json").read_text())["budget_tokens"] == result["budget_tokens"]


def test_rerun_resumes_from_finished_runs(recovered):
    args, result, out = recovered
    stamp = {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/result.json")}
    with one_thread():
        again = run_recovery(args)
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").glob("*/result.json")} == stamp  # nothing re-run
    assert again["policies"]["uniform"]["copy"] == result["policies"]["uniform"]["copy"]


def test_alignment_covers_only_converted_layers(recovered):
    """Phase 2 runs on the union of the layers the policies convert (kept layers are never aligned)."""
    from safetensors.torch import load_file

    from taylor_calibrate.policy import gdn_layers

    _, result, out = recovered
    union = sorted({i for kept in result["kept"].values() for i in gdn_layers(kept, 4)})
    for name in ("copy+align", "taylor+align"):
        layers = sorted({int(k.split(".", 1)[0]) for k in load_file(str(out / "mixers" / f"{name}.safetensors"))})
        assert layers == union
    phase1 = sorted({int(k.split(".", 1)[0]) for k in load_file(str(out / "mixers" / "taylor.safetensors"))})
    assert phase1 == [0, 1, 2, 3]


def test_time_limit_stops_cleanly_and_the_same_command_continues(recovered, tmp_path):
    """--time_limit_s: the run in progress checkpoints and the experiment stops, marked incomplete; the same command
    then finishes it, on the same curve as an uninterrupted run (same data order, same mixers)."""
    import dataclasses

    args, result, out = recovered
    part = dataclasses.replace(args, out=str(tmp_path / "part"), policies=["uniform"], inits=["copy"], extra=[],
                               niah=False, time_limit_s=0.0)
    with one_thread():
        stopped = run_recovery(part)
    assert stopped["complete"] is False and stopped["policies"]["uniform"] == {}
    ckpt = json.loads((tmp_path / "part" / "runs" / "uniform__copy" / "checkpoints" / "latest.json").read_text())
    assert ckpt["step"] == 1
    with one_thread():
        done = run_recovery(dataclasses.replace(part, time_limit_s=None))
    assert done["complete"] is True
    want = result["policies"]["uniform"]["copy"]
    assert done["policies"]["uniform"]["copy"]["heldout_loss"] == pytest.approx(want["heldout_loss"], rel=1e-5)
