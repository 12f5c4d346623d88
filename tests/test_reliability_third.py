"""Reliability, third round (issue 40 re-checked with inputs of another sweep), through the CLI: each case the sweep
found ends with exit 2 and one line naming the file or option and the fix (or, for the token cache, never writes into
an input), and the user's directories hash the same before and after. Refusals that come before any model is loaded
call the CLI's `main` in this process; a pipe that would block a reader runs in a subprocess with a deadline."""
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import VOCAB, tiny_local_teacher
from test_reliability import ENV, _cmd, cli, fails, succeeds, tree
from test_reliability_inputs import SMALL, main

EVAL = ["--data.seq_len", "64", "--data.eval_seqs", "2", "--device", "cpu", "--backend", "torch"]
TRAIN = ["--device", "cpu", "--backend", "torch", "--data.seq_len", "32", "--data.eval_seqs", "2",
         "--eval_batch_size", "2", "--train.batch_size", "2", "--train.tokens", "256", "--train.log_every", "1",
         "--train.save_every", "1"]


@pytest.fixture(scope="module")
def rw(tmp_path_factory):
    """(root, teacher, corpus, a converted hybrid, an exportable hybrid)."""
    from test_export_qwen3_5 import tiny_hybrid

    from taylor_calibrate.checkpoint import save_hybrid
    from taylor_calibrate.teacher import load_tokenizer

    root = tmp_path_factory.mktemp("third")
    teacher, corpus = tiny_local_teacher(root)
    hybrid = root / "hybrid"
    succeeds(cli("convert", "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", hybrid))
    _, exportable = tiny_hybrid(vocab_size=VOCAB)
    save_hybrid(exportable, load_tokenizer(str(hybrid)), root / "exportable")
    return root, teacher, corpus, hybrid, root / "exportable"


@pytest.fixture(autouse=True)
def inputs_untouched(request):
    if "rw" not in request.fixturenames:
        yield
        return
    root, teacher, corpus, hybrid, exportable = request.getfixturevalue("rw")
    before = [tree(p) for p in (teacher, corpus, hybrid, exportable)]
    yield
    assert [tree(p) for p in (teacher, corpus, hybrid, exportable)] == before


def _copy(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


# --- damage's --out ---------------------------------------------------------------------------------------------
def test_damage_into_a_non_empty_out_is_refused_not_a_key_error(rw):
    """`damage` checks its --out like every other command: a non-empty directory that is not an earlier damage output
    needs --overwrite (it was a KeyError: damage had no entry among the commands' output marks)."""
    root, teacher, corpus, hybrid, _ = rw
    d = root / "mine"
    d.mkdir(exist_ok=True)
    (d / "notes.txt").write_text("mine\n")
    fails(main("damage", "--teacher", teacher, "--data.source", corpus, "--out", d), "not an earlier `damage` output",
          "--overwrite true")
    assert tree(d) == {"notes.txt": tree(d)["notes.txt"]} and (d / "notes.txt").read_text() == "mine\n"


def test_every_command_that_writes_has_output_marks():
    from taylor_calibrate import checks
    from taylor_calibrate.cli import COMMANDS

    writers = {name for name, (_, fn) in COMMANDS.items() if fn.__code__.co_name == "run"}  # wrapped by writes_out
    assert writers and writers <= set(checks._OUTPUT_MARKS), writers - set(checks._OUTPUT_MARKS)


# --- `report` of a damaged results file -------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["env_list", "commit_number", "args_string", "pipe"])
def test_report_of_a_damaged_results_file_or_a_pipe_is_one_line(rw, damage):
    """Valid JSON whose provenance keys have the wrong type was an AttributeError in `render`; a pipe was said not to
    exist."""
    root, teacher, corpus, hybrid, _ = rw
    f = root / f"report_{damage}.json"
    f.unlink(missing_ok=True)
    if damage == "pipe":
        os.mkfifo(f)
        fails(main("report", "--file", f), r"report_pipe\.json is not a regular file", "pass a results JSON file")
        return
    rep = json.loads((hybrid / "report.json").read_text())
    key, value = {"env_list": ("env", ["cpu"]), "commit_number": ("commit", 5), "args_string": ("args", "x")}[damage]
    f.write_text(json.dumps({**rep, key: value}))
    fails(main("report", "--file", f), rf"report_{damage}\.json is not a results file", f"{key} is a",
          "run the command that wrote it again")
