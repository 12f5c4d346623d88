"""The `recovery` experiment on a tiny local teacher: the committed JSON schema, curves, tokens-to-match, resume."""
import json
import math

import pytest
import torch
from conftest import one_thread, tiny_local_teacher

from taylor_calibrate.config import AlignArgs, DataArgs, RecoveryArgs, TrainArgs
from taylor_calibrate.experiments.recovery import run_recovery, tokens_to_match, tokens_to_reach


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


# --- retrieval-scored policies: students built by convert, cached ---------------------------------------------------
@pytest.fixture(scope="module")
def recovered_heads(tmp_path_factory):
    """recovery --policies '[heads]' with two inits: each student built by convert (head-wise)."""
    root = tmp_path_factory.mktemp("recovery_heads")
    teacher_dir, corpus = tiny_local_teacher(root, max_position_embeddings=1024)
    args = RecoveryArgs(
        teacher=str(teacher_dir), out=str(root / "out"), kv_budget=0.25, probe_samples=1, profile="quick",
        device="cpu", backend="torch", policies=["heads"], inits=["copy", "taylor+align"], extra=[],
        data=DataArgs(source=str(corpus), seq_len=32, calib_seqs=4, eval_seqs=2), eval_batch_size=2,
        phase2=AlignArgs(steps=3, batch_size=2), train=TrainArgs(tokens=4 * 2 * 32, batch_size=2, lr=1e-2, eval_every=2),
        niah_tasks=["single"], niah_lengths=[512], niah_samples=1, niah_points=2,
        command="pytest tests/test_recovery.py",
    )
    with one_thread():
        return args, run_recovery(args), root / "out"


def _no_conversion(*a, **k):
    raise AssertionError("convert called: the cached student should have been read")


def test_heads_policy_runs_on_converted_students(recovered_heads):
    args, result, out = recovered_heads
    runs = result["policies"]["heads"]
    assert result["complete"] is True and set(runs) >= {"copy", "taylor+align", "tokens_to_match"}
    for init in ("copy", "taylor+align"):
        assert runs[init]["tokens"] == [0, 128, 256] and all(math.isfinite(x) for x in runs[init]["heldout_loss"])
        assert [c["tokens"] for c in runs[init]["niah_curve"]] == [0, 256]
    students = result["students"]["heads"]
    assert students["copy"]["headwise_kept_groups"] == students["taylor+align"]["headwise_kept_groups"]
    assert students["copy"]["gdn_layers"] == runs["copy"]["gdn_layers"] == runs["taylor+align"]["gdn_layers"]
    groups = result["kept_groups"]["heads"]
    assert groups == students["copy"]["headwise_kept_groups"] and groups  # head-wise layers at 25% KV of 4 x 2 groups
    assert 0 < result["kv_fraction"]["heads"] <= args.kv_budget and result["kept_fraction"] <= args.kv_budget
    for init in ("copy", "taylor+align"):  # the run starts from convert's hybrid: same held-out rows, same loss
        assert runs[init]["heldout_loss"][0] == pytest.approx(math.log(students[init]["hybrid_ppl"]), rel=1e-4)
    assert f"heads {result['kv_fraction']['heads']:.1%} of the KV cache kept" in (out / "recovery.md").read_text()


def test_heads_rerun_reads_the_cached_students(recovered_heads, monkeypatch):
    """A second invocation converts nothing: a finished experiment only re-summarises, and a run to redo starts
    from its cached student (the same curve as the first time)."""
    import shutil

    from taylor_calibrate.experiments import recovery

    args, result, out = recovered_heads
    monkeypatch.setattr(recovery, "convert", _no_conversion)
    shutil.rmtree(out / "runs" / "heads__taylor+align")
    with one_thread():
        again = run_recovery(args)
    assert again["complete"] is True and again["kept_groups"] == result["kept_groups"]
    want = result["policies"]["heads"]["taylor+align"]["heldout_loss"]
    assert again["policies"]["heads"]["taylor+align"]["heldout_loss"] == pytest.approx(want, rel=1e-5)


def test_heads_time_limit_resumes_without_converting_again(recovered_heads, tmp_path, monkeypatch):
    import dataclasses

    from taylor_calibrate.experiments import recovery

    args, result, out = recovered_heads
    part = dataclasses.replace(args, out=str(tmp_path / "part"), inits=["taylor+align"], niah=False,
                               time_limit_s=0.0)
    with one_thread():
        stopped = run_recovery(part)
    assert stopped["complete"] is False and stopped["policies"]["heads"] == {}
    assert stopped["kept_groups"] == result["kept_groups"]
    monkeypatch.setattr(recovery, "convert", _no_conversion)
    with one_thread():
        done = run_recovery(dataclasses.replace(part, time_limit_s=None))
    assert done["complete"] is True
    want = result["policies"]["heads"]["taylor+align"]["heldout_loss"]
    assert done["policies"]["heads"]["taylor+align"]["heldout_loss"] == pytest.approx(want, rel=1e-5)


def test_each_student_is_converted_when_its_run_comes_up(recovered_heads, tmp_path, monkeypatch):
    """A call the time limit stops converts only the student it trains (a run's convert is minutes on a fresh
    machine); the call that continues converts the next run's, and the curves are the untimed experiment's."""
    import dataclasses

    from taylor_calibrate.experiments import recovery

    args, result, out = recovered_heads
    built = []
    real = recovery.convert
    monkeypatch.setattr(recovery, "convert", lambda conv, *a, **k: built.append(conv.init) or real(conv, *a, **k))
    part = dataclasses.replace(args, out=str(tmp_path / "part"), niah=False, time_limit_s=0.0)
    with one_thread():
        stopped = run_recovery(part)
    assert built == ["copy"] and stopped["complete"] is False
    assert stopped["kept_groups"] == result["kept_groups"]
    with one_thread():
        done = run_recovery(dataclasses.replace(part, time_limit_s=None))
    assert built == ["copy", "taylor"] and done["complete"] is True
    for init in ("copy", "taylor+align"):
        want = result["policies"]["heads"][init]["heldout_loss"]
        assert done["policies"]["heads"][init]["heldout_loss"] == pytest.approx(want, rel=1e-5)


def test_small_files_carried_to_a_fresh_machine_continue_the_experiment(recovered_heads, tmp_path, monkeypatch):
    """A long experiment split over machines: only the small files of its finished runs travel (options, the
    teacher's NIAH, the students' JSON, each run's result and NIAH records; no weights or checkpoints). The same
    command there converts nothing for those runs and builds only the student of the run left to train."""
    import dataclasses
    import shutil

    from taylor_calibrate.experiments import recovery

    args, result, out = recovered_heads
    fresh = tmp_path / "fresh"
    small = ["options.json", "teacher_niah.json", "students/heads__copy.json", "students/heads__taylor+align.json",
             "runs/heads__copy/result.json", "runs/heads__copy/niah.jsonl"]
    for f in small:
        (fresh / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / f, fresh / f)
    built = []
    real = recovery.convert
    monkeypatch.setattr(recovery, "convert", lambda conv, *a, **k: built.append(conv.init) or real(conv, *a, **k))
    with one_thread():
        again = run_recovery(dataclasses.replace(args, out=str(fresh)))
    assert built == ["taylor"]  # taylor+align's student only: copy's finished run needs no weights
    assert again["complete"] is True and again["kept_groups"] == result["kept_groups"]
    for init in ("copy", "taylor+align"):
        want = result["policies"]["heads"][init]["heldout_loss"]
        assert again["policies"]["heads"][init]["heldout_loss"] == pytest.approx(want, rel=1e-5)
    assert again["policies"]["heads"]["tokens_to_match"] == pytest.approx(result["policies"]["heads"]["tokens_to_match"])


def test_retrieval_policies_are_accepted_and_others_fail_early():
    from taylor_calibrate.experiments.recovery import parse_runs

    args = RecoveryArgs(policies=["auto", "heads", "retrieval", "uniform"], inits=["copy", "align"], extra=[])
    assert len(parse_runs(args)) == 8
    with pytest.raises(ValueError, match="unknown layer policy"):
        parse_runs(RecoveryArgs(policies=["head"], extra=[]))


def test_niah_runs_compiled_layers_eagerly(tmp_path, single_thread):
    """NIAH along a run scores the model distill compiled: it must not compile graphs for generation's shapes."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from taylor_calibrate.config import GDNConfig
    from taylor_calibrate.distill import compile_layers, uncompile_layers
    from taylor_calibrate.model.hybrid import convert_teacher
    from taylor_calibrate.experiments.recovery import _niah

    teacher_dir, _ = tiny_local_teacher(tmp_path, max_position_embeddings=1024)
    tok, teacher = AutoTokenizer.from_pretrained(teacher_dir), AutoModelForCausalLM.from_pretrained(teacher_dir)
    hybrid = convert_teacher(teacher, [0, 2], GDNConfig())
    hybrid.set_backend("torch")
    args = RecoveryArgs(niah_tasks=["single"], niah_lengths=[512], niah_samples=1)
    compile_layers(hybrid)
    counters.clear()
    try:
        scores = _niah(hybrid, tok, args, torch.device("cpu"), "niah")
    finally:
        uncompile_layers(hybrid)
    assert set(scores["single"]) == {"512"} and counters["stats"]["unique_graphs"] == 0


def test_torchrun_two_processes_follow_one(tmp_path):
    """recovery under torchrun (2 processes, gloo): every run trains data-parallel and follows the 1-process curves;
    NIAH is scored once per point (by the first process)."""
    import os
    import subprocess
    import sys

    teacher_dir, corpus = tiny_local_teacher(tmp_path, max_position_embeddings=1024)

    def argv(out):
        return ["recovery", "--teacher", str(teacher_dir), "--out", str(out), "--keep_every", "2", "--profile", "quick",
                "--device", "cpu", "--backend", "torch", "--data.source", str(corpus), "--data.seq_len", "32",
                "--data.calib_seqs", "4", "--data.eval_seqs", "2", "--eval_batch_size", "2", "--phase2.steps", "3",
                "--phase2.batch_size", "2", "--train.tokens", str(4 * 4 * 32), "--train.batch_size", "4",
                "--train.lr", "1e-2", "--train.eval_every", "2", "--policies", "[uniform]",
                "--inits", "[copy,taylor+align]", "--extra", "[]", "--niah_tasks", "[passkey]",
                "--niah_lengths", "[512]", "--niah_samples", "1", "--niah_points", "3"]

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    one, two = tmp_path / "one", tmp_path / "two"
    r = subprocess.run([sys.executable, "-m", "taylor_calibrate", *argv(one)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
                        "taylor_calibrate", *argv(two)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    a, b = (json.loads((o / "recovery.json").read_text()) for o in (one, two))
    assert b["complete"] and "tokens_to_match" in b["policies"]["uniform"]
    for init in ("copy", "taylor+align"):
        x, y = a["policies"]["uniform"][init], b["policies"]["uniform"][init]
        assert y["tokens"] == x["tokens"]
        assert y["heldout_loss"] == pytest.approx(x["heldout_loss"], rel=1e-4), init
        assert len(y["niah_curve"]) == 3  # steps 0, 2, 4: once each, not once per process
        assert (x["processes"], y["processes"]) == (1, 2)
