"""Whose output an --out holds, through the CLI: an earlier output is recognised by the content of the files its
command writes (a user's directory holding files or folders of the same names is refused, untouched)."""
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
