"""taylor_calibrate/results.py: what a results JSON records, the dirty flag, the atomic write, the markdown view."""
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from taylor_calibrate import results
from taylor_calibrate.cli import main


@dataclass
class _Args:
    steps: int = 3
    lr: float = 1e-3
    command: str | None = None


def _git(repo: Path, *cmd: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *cmd], check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q")
    (root / "code.py").write_text("x = 1\n")
    _git(root, "add", "code.py")
    _git(root, "commit", "-q", "-m", "first")
    return root


def test_record_writes_result_and_provenance(tmp_path, repo):
    path = tmp_path / "out" / "r.json"
    args = _Args(steps=7, command="taylor-calibrate convert --steps 7")
    written = results.record(path, {"ppl": 4.5, "rows": [{"a": 1}]}, args, repo=repo)
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(written))
    assert on_disk["ppl"] == 4.5 and on_disk["rows"] == [{"a": 1}]
    assert on_disk["commit"] == _git(repo, "rev-parse", "HEAD").strip()
    assert on_disk["dirty"] is False
    assert on_disk["args"] == {"steps": 7, "lr": 1e-3, "command": "taylor-calibrate convert --steps 7"}
    assert on_disk["command"] == "taylor-calibrate convert --steps 7"
    env = on_disk["env"]
    for key in ("python", "torch", "transformers", "fla", "triton", "gpu"):
        assert key in env, key
    assert env["torch"] and env["transformers"] and env["gpu"]
    assert os.uname().nodename not in json.dumps(env)


def test_dirty_flag_follows_tracked_changes_only(tmp_path, repo):
    (repo / "untracked.txt").write_text("outputs do not make a tree dirty\n")
    assert results.git_state(repo)[1] is False
    (repo / "code.py").write_text("x = 2\n")
    commit, dirty = results.git_state(repo)
    assert dirty is True and commit == _git(repo, "rev-parse", "HEAD").strip()
    assert results.record(tmp_path / "r.json", {}, repo=repo)["dirty"] is True


def test_outside_git_commit_and_dirty_are_null(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    assert results.git_state(plain) == (None, None)
    assert results.record(tmp_path / "r.json", {"x": 1}, {"a": 1}, command="c", repo=plain)["commit"] is None


def test_package_records_its_own_repository():
    commit, dirty = results.git_state()
    if (Path(results.__file__).parents[1] / ".git").exists():
        assert commit and len(commit) == 40 and dirty in (True, False)


def test_atomic_write_leaves_old_file_and_no_partial_file(tmp_path, repo):
    path = tmp_path / "r.json"
    results.record(path, {"v": 1}, repo=repo)
    before = path.read_text()
    with pytest.raises(TypeError):  # the write fails after the temporary file was created: the old file stays whole
        results.write_text(path, _Unwritable())
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["r.json"]  # no temporary file left


class _Unwritable:
    """Not a string: the file write raises after the temporary file was created."""


def test_command_line_reads_as_typed():
    assert results.command_line(["/x/taylor_calibrate/__main__.py", "convert", "--out", "a b"]) == \
        "python -m taylor_calibrate convert --out 'a b'"
    assert results.command_line(["benchmarks/decisions.py", "--steps", "3"]) == "python benchmarks/decisions.py --steps 3"
    assert results.command_line(["/venv/bin/taylor-calibrate", "eval"]) == "taylor-calibrate eval"


def test_report_renders_the_json(tmp_path, repo, capsys):
    path = tmp_path / "r.json"
    results.record(path, {"teacher_ppl": 3.369, "rows": [{"init": "taylor", "ppl": 3.95}]}, _Args(command="cmd"),
                   repo=repo)
    assert main(["report", "--file", str(path)]) == 0
    md = capsys.readouterr().out
    commit = _git(repo, "rev-parse", "HEAD").strip()
    assert f"`{commit}`" in md and "`cmd`" in md and "| teacher_ppl | 3.369 |" in md
    assert "| init | ppl |" in md and "| taylor | 3.95 |" in md
    out = tmp_path / "r.md"
    assert main(["report", "--file", str(path), "--out", str(out)]) == 0 and out.read_text() == md
    assert main(["report", "--file", str(path), "--out", str(out)]) == 2  # never overwrites
    assert "exists" in capsys.readouterr().err
    assert main(["report", "--file", str(tmp_path / "missing.json")]) == 2


def test_record_keeps_the_commit_the_run_started_from(tmp_path, monkeypatch):
    """A run that outlives a commit records the code it ran (the state read when the command started), not the later
    HEAD."""
    monkeypatch.setattr(results, "package_state", lambda: ("abc123", False))
    assert results.record(tmp_path / "r.json", {"x": 1})["commit"] == "abc123"
