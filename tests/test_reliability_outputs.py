"""Whose output an --out holds, through the CLI: an earlier output is recognised by the content of the files its
command writes (a user's directory holding files or folders of the same names is refused, untouched), and a distill
run started over an earlier one needs --overwrite true, which deletes that output as the run starts, so the directory
never mixes two runs."""
import json
import shutil
from pathlib import Path

import pytest
from test_reliability import fails, succeeds, tree
from test_reliability_inputs import converted_world, main

TRAIN = ["--device", "cpu", "--backend", "torch", "--data.seq_len", "32", "--data.eval_seqs", "2",
         "--eval_batch_size", "2", "--train.batch_size", "2", "--train.tokens", "256", "--train.log_every", "1",
         "--train.save_every", "1"]  # 4 steps, a checkpoint after each


@pytest.fixture(scope="module")
def ow(tmp_path_factory):
    """(root, teacher, corpus, hybrid, a finished distill run of the hybrid)."""
    root = tmp_path_factory.mktemp("outputs")
    teacher, corpus, hybrid = converted_world(root)
    run = root / "run"
    succeeds(main("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", run))
    return root, teacher, corpus, hybrid, run


@pytest.fixture(autouse=True)
def inputs_untouched(request):
    if "ow" not in request.fixturenames:
        yield
        return
    root, teacher, corpus, hybrid, run = request.getfixturevalue("ow")
    before = [tree(p) for p in (teacher, corpus, hybrid, run)]
    yield
    assert [tree(p) for p in (teacher, corpus, hybrid, run)] == before


def _copy(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def _distill(ow, out, *more):
    root, teacher, corpus, hybrid, run = ow
    return main("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", out, *more)


# --- a distill run over an earlier one ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["resume_false", "no_checkpoints"])
def test_a_new_run_over_a_finished_one_needs_overwrite(ow, case):
    """--resume false (or nothing left to resume from) over another run's model/ and report.json: the old files stayed
    until the new run ended, so a crash left a report describing a model being replaced. Refused before any work."""
    root = ow[0]
    d = _copy(ow[4], root / f"finished_{case}")
    if case == "no_checkpoints":
        shutil.rmtree(d / "checkpoints")
    before = tree(d)
    more = ["--resume", "false"] if case == "resume_false" else []
    why = "--resume false starts a new run there" if case == "resume_false" else "holds no checkpoint to resume from"
    fails(_distill(ow, d, *more), "holds an earlier distill run's output", why, "--overwrite true to replace it")
    assert tree(d) == before


def test_overwrite_deletes_the_earlier_run_as_it_starts_so_a_crash_leaves_no_mix(ow):
    """With --overwrite true the earlier run's report.json, model/, metrics and checkpoints go as the run starts: a
    new run that fails midway (a diverging loss) leaves none of them beside its own files; one that finishes leaves
    only its own; a user's file in the directory stays."""
    root = ow[0]
    d = _copy(ow[4], root / "replaced")
    (d / "notes.txt").write_text("mine\n")
    fails(_distill(ow, d, "--resume", "false", "--overwrite", "true", "--train.lr", "1e30", "--train.grad_clip", "0"),
          r"held-out loss is (nan|inf) at step \d+")
    assert not (d / "report.json").exists() and not (d / "model").exists()
    steps = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(0) == 1, steps  # one run's records, not two
    for ckpt in (d / "checkpoints").glob("step_*"):  # only the diverging run's
        assert json.loads((ckpt / "state.json").read_text())["identity"]["train"]["lr"] == 1e30
    assert (d / "notes.txt").read_text() == "mine\n"

    succeeds(_distill(ow, d, "--resume", "false", "--overwrite", "true", "--train.lr", "2e-3"))
    report = json.loads((d / "report.json").read_text())
    assert report["args"]["train"]["lr"] == 2e-3 and report["resumed_from"] is None
    steps = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(0) == 1, steps
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["latest.json", "step_00000003", "step_00000004"]
    assert (d / "model" / "model.safetensors").exists() and (d / "notes.txt").read_text() == "mine\n"


def test_the_same_command_again_resumes_without_overwrite(ow):
    """The finished run's own command, run again, resumes (nothing to replace), as before."""
    d = _copy(ow[4], ow[0] / "again")
    succeeds(_distill(ow, d))
    assert json.loads((d / "report.json").read_text())["resumed_from"] == 4


@pytest.mark.parametrize("name", ["model", "report.json", "metrics.jsonl"])
def test_overwrite_never_replaces_a_users_file_of_a_name_distill_writes(ow, name):
    """--overwrite true writes distill's files among a user's: a model/ folder, report.json or metrics.jsonl of
    theirs would have been replaced (the folder by the trained model). Refused, untouched."""
    d = ow[0] / f"users_{name}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    if name == "model":
        (d / "model").mkdir()
        (d / "model" / "weights.bin").write_bytes(b"mine")
    else:
        (d / name).write_text('{"mine": 1}\n')
    before = tree(d)
    fails(_distill(ow, d, "--overwrite", "true"), rf"holds a {name} that distill did not write",
          "pass another --out")
    assert tree(d) == before


# --- outputs recognised by content, not by name ------------------------------------------------------------------
LOOK_ALIKES = {
    "distill": {"metrics.jsonl": '{"epoch": 1, "loss": 2.5}\n', "checkpoints/latest.json": '{"path": "mine.pt"}'},
    "recovery": {"runs/first/notes.txt": "mine\n", "mixers/recipe.txt": "mine\n",
                 "runs/first/metrics.jsonl": '{"epoch": 1}\n'},
    "tokenize": {"tokens.json": '{"tokens": ["river", "stone"]}'},
    "ablate": {"ablation.json": '{"notes": "mine"}'},
    "tradeoff": {"tradeoff.json": '{"rows": []}'},
    "damage": {"damage.json": "[1, 2]"},
    "convert": {"report.json": '{"hybrid_ppl": 3.0}'},
    "eval": {"report.json": '{"model_ppl": 3.0}'},
}


@pytest.mark.parametrize("command", LOOK_ALIKES)
def test_a_users_directory_with_look_alike_names_is_not_taken_for_an_earlier_output(ow, command):
    """Each command decided --out was its own earlier output (so wrote, resumed or replaced there without
    --overwrite) from a file or folder name alone: distill's metrics.jsonl, recovery's runs/ and mixers/, tokenize's
    tokens.json, ... A user's directory holding such names is refused as any other non-empty one, untouched."""
    root, teacher, corpus, hybrid, run = ow
    d = root / f"look_alike_{command}"
    shutil.rmtree(d, ignore_errors=True)
    for name, text in LOOK_ALIKES[command].items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    before = tree(d)
    data = ["--data.source", corpus, "--device", "cpu"]
    argv = {"distill": ["distill", "--student", hybrid, *data], "eval": ["eval", "--model", hybrid, *data],
            "tokenize": ["tokenize", "--model", teacher, "--data.source", corpus]}.get(command,
                                                                                       [command, "--teacher", teacher,
                                                                                        *data])
    fails(main(*argv, "--out", d), f"not an earlier `{command}` output", "pass a new or empty directory")
    assert tree(d) == before


def test_a_corpus_holding_a_tokens_json_is_read_as_a_corpus(ow):
    """A corpus directory of the user's with a tokens.json of its own was taken for token shards: convert refused it
    as shards, distill called it damaged and said to delete it. Read as the corpus it is, untouched."""
    root, teacher, corpus, hybrid, run = ow
    c = _copy(corpus, root / "corpus_with_tokens_json")
    (c / "tokens.json").write_text('{"tokens": ["river", "stone"], "note": "my word list"}')
    before = tree(c)
    out = root / "shards_of_corpus_with_tokens_json"
    succeeds(main("tokenize", "--model", teacher, "--data.source", c, "--out", out))
    assert json.loads((out / "tokens.json").read_text())["documents"]["calib"] > 0 and tree(c) == before
