"""Reliability, second round (issue 40), through the CLI: --out never is, holds or lies inside an input; one writer
per output (a lock held by a real process); non-finite options refused at parse; no remote code on a terminal or
off one. Refusals come before any model is loaded: those cases call the CLI's `main` in this process (a process
start costs seconds); holders of a lock, hangs and terminals are real processes."""
import contextlib
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_local_teacher
from test_reliability import ENV, _cmd, cli, fails, succeeds, tree

main = cli  # `taylor-calibrate *argv` in this process: (exit code, what it printed and logged)


SMALL = ["--data.seq_len", "64", "--data.calib_seqs", "4", "--data.eval_seqs", "2", "--phase2.steps", "2",
         "--device", "cpu", "--backend", "torch"]


def converted_world(root):
    """A tiny local teacher, its corpus, and the hybrid `convert` makes of them, all under root."""
    teacher, corpus = tiny_local_teacher(root)
    hybrid = root / "hybrid"
    succeeds(cli("convert", "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", hybrid))
    return teacher, corpus, hybrid


@pytest.fixture(scope="module")
def tw(tmp_path_factory):
    """(root, teacher, corpus, a converted hybrid) with the hashes of teacher, corpus and hybrid."""
    root = tmp_path_factory.mktemp("inputs")
    return (root, *converted_world(root))


def untouched(request, world: str):
    """An autouse fixture's body: when the test uses fixture `world` (root, then the directories the commands read),
    every one of those directories is byte for byte the same after the test."""
    if world not in request.fixturenames:
        yield
        return
    inputs = request.getfixturevalue(world)[1:]
    before = [tree(p) for p in inputs]
    yield
    assert [tree(p) for p in inputs] == before


def copy_tree(src, dst):
    """A fresh copy of directory src at dst (a test's own copy of a shared output to damage or re-run)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(autouse=True)
def inputs_untouched(request):
    yield from untouched(request, "tw")


# --- never write over or inside an input -----------------------------------------------------------------------
def _writers(root, teacher, corpus, hybrid, out):
    """One command line per command that writes, all with --out `out`."""
    data = ["--data.source", corpus]
    return {
        "convert": ["convert", "--teacher", teacher, *data, "--out", out, "--overwrite", "true"],
        "distill": ["distill", "--student", hybrid, "--teacher", teacher, *data, "--out", out, "--overwrite", "true"],
        "tokenize": ["tokenize", "--model", teacher, *data, "--out", out],
        "eval": ["eval", "--model", hybrid, "--teacher", teacher, *data, "--out", out, "--overwrite", "true"],
        "export": ["export", "--model", hybrid, "--out", out],
        "ablate": ["ablate", "--teacher", teacher, *data, "--out", out, "--overwrite", "true"],
        "recovery": ["recovery", "--teacher", teacher, *data, "--out", out, "--overwrite", "true"],
        "tradeoff": ["tradeoff", "--teacher", teacher, *data, "--out", out, "--overwrite", "true"],
    }


@pytest.mark.parametrize("command", ["convert", "distill", "tokenize", "eval", "export", "ablate", "recovery",
                                     "tradeoff"])
def test_out_is_holds_or_lies_inside_an_input(tw, command):
    root, teacher, corpus, hybrid = tw
    cases = [(corpus, "is the --data.source directory"), (root, "holds the"), (corpus / "sub", "lies inside the "
             "--data.source"), (teacher / "hybrid", "lies inside the --(teacher|model)")]
    if command in ("distill",):
        cases.append((hybrid / "run", "lies inside the --student"))
    if command == "export":  # its only input is --model
        cases = [(hybrid, "is the --model directory"), (root, "holds the --model"),
                 (hybrid / "qwen", "lies inside the --model")]
    if command == "tokenize":
        cases.append((teacher, "is the --model directory"))
    for out, message in cases:
        fails(main(*_writers(root, teacher, corpus, hybrid, out)[command]), f"--out .*{message}", "pass another --out")
        assert not (corpus / "sub").exists() and not (teacher / "hybrid").exists() and not (hybrid / "run").exists()


def test_eval_may_write_inside_its_model_but_not_inside_its_teacher(tw):
    root, teacher, corpus, hybrid = tw
    fails(main("eval", "--model", hybrid, "--teacher", teacher, "--data.source", corpus, "--out", teacher / "ev"),
          "lies inside the --teacher")


def test_a_fifo_data_source_is_refused_not_waited_on(tw):
    root, teacher, corpus, hybrid = tw
    fifo = root / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    r = subprocess.run(_cmd(["tokenize", "--model", teacher, "--data.source", fifo, "--out", root / "tok_fifo"]),
                       env=ENV, capture_output=True, text=True, timeout=300)
    fails((r.returncode, r.stdout + r.stderr), "is not a regular file or directory", "save the text to a file")
    assert not (root / "tok_fifo").exists()


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail instead of hanging: SIGALRM interrupts a blocked open() of a pipe."""
    def expired(*_):
        raise TimeoutError(f"still waiting after {seconds} s: a reader blocked on a pipe")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_pipes_where_our_files_belong_are_refused_not_waited_on(tw):
    """A pipe as --config, as the teacher's config.json or GGUF, as a model directory's JSON or weights: refused at
    once, naming it (a reader would block for ever)."""
    root, teacher, corpus, hybrid = tw
    pipes = root / "pipes"
    t, m, m2 = pipes / "teacher", pipes / "model", pipes / "model2"
    if not pipes.exists():
        for src, dst in ((teacher, t), (hybrid, m), (hybrid, m2)):
            shutil.copytree(src, dst)
        for f in (t / "config.json", m / "tokenizer_config.json", m2 / "w.safetensors"):
            f.unlink(missing_ok=True)
            os.mkfifo(f)
        for f in (pipes / "run.yaml", pipes / "t.gguf"):
            os.mkfifo(f)
    cases = [(["convert", "--config", pipes / "run.yaml", "--out", pipes / "o1"], r"--config .*run\.yaml is not a regular"),
             (["convert", "--teacher", t, "--out", pipes / "o2"], r"teacher/config\.json is not a regular file"),
             (["convert", "--teacher", pipes / "t.gguf", "--out", pipes / "o3"], r"t\.gguf' is not a regular file"),
             (["eval", "--model", m, "--data.source", corpus], r"tokenizer_config\.json is not a regular file"),
             (["eval", "--model", m2, "--data.source", corpus], r"w\.safetensors is not a regular file")]
    with _deadline(120):
        for argv, pattern in cases:
            fails(main(*argv, "--device", "cpu"), pattern)
    assert not [p for p in pipes.iterdir() if p.name.startswith("o")]


def test_a_dangling_link_out_fails_before_any_work(tw):
    root, teacher, corpus, hybrid = tw
    link = root / "dangling"
    if not link.is_symlink():
        link.symlink_to(root / "nowhere")
    rc, log = main("convert", "--teacher", teacher, "--data.source", corpus, "--out", link)
    fails((rc, log), "is a link to .*nowhere, which does not exist")
    assert "loading teacher" not in log


def test_a_link_loop_out_is_named_as_a_loop(tw):
    root, teacher, corpus, hybrid = tw
    a, b = root / "loop_a", root / "loop_b"
    for link, target in ((a, b), (b, a)):
        if not link.is_symlink():
            link.symlink_to(target)
    rc, log = main("convert", "--teacher", teacher, "--data.source", corpus, "--out", a)
    fails((rc, log), "is a link that leads back to itself .*loop_b")
    assert "does not exist" not in log and "loading teacher" not in log


def test_export_hint_does_not_offer_overwrite(tw):
    root, teacher, corpus, hybrid = tw
    d = root / "full"
    d.mkdir(exist_ok=True)
    (d / "mine.txt").write_text("mine")
    err = fails(main("export", "--model", hybrid, "--out", d), "non-empty directory", "never overwritten")
    assert "--overwrite" not in err and (d / "mine.txt").read_text() == "mine"


def test_eval_writes_its_default_report_only_inside_a_hybrid_of_ours(tw):
    """Without --out, eval writes <model>/eval: inside a `convert` output, never inside a teacher the user owns."""
    root, teacher, corpus, hybrid = tw
    data = ["--data.source", corpus, "--data.seq_len", "64", "--data.eval_seqs", "2", "--device", "cpu",
            "--backend", "torch"]
    fails(main("eval", "--model", teacher, *data), "is not a hybrid of taylor-calibrate", "'llama'", "pass --out")
    assert not (teacher / "eval").exists()
    mine = root / "default_eval_hybrid"
    if not mine.exists():
        shutil.copytree(hybrid, mine)
    succeeds(main("eval", "--model", mine, *data))
    assert "model_ppl" in json.loads((mine / "eval" / "report.json").read_text())


@pytest.mark.parametrize("command", ["distill", "eval"])
def test_overwrite_never_writes_among_another_commands_output(tw, command):
    """distill and eval write into --out: with --overwrite true into a `convert` output they left its model beside
    their own report (read back as one directory). Refused before any work, the output untouched."""
    root, teacher, corpus, hybrid = tw
    out = root / "converted_out"
    if not out.exists():
        shutil.copytree(hybrid, out)
    before = tree(out)
    argv = {"distill": ["distill", "--student", hybrid, "--teacher", teacher],
            "eval": ["eval", "--model", hybrid]}[command]
    fails(main(*argv, "--data.source", corpus, "--device", "cpu", "--out", out, "--overwrite", "true"),
          "holds an earlier `convert` output", f"`{command}` would write its files among them", "pass another --out")
    assert tree(out) == before


def test_a_users_checkpoints_folder_is_not_taken_for_an_earlier_distill(tw):
    """A directory of the user's holding a `checkpoints/` folder of their own passed as distill's --out: it was taken
    for an earlier distill output, written into without --overwrite, and the folder deleted (distill starting afresh
    clears its checkpoints); with --overwrite true, its files are kept."""
    root, teacher, corpus, hybrid = tw
    d = root / "users_dir"
    (d / "checkpoints").mkdir(parents=True, exist_ok=True)
    (d / "checkpoints" / "my_model.pt").write_text("mine")
    before = tree(d)
    fails(main("distill", "--student", hybrid, "--teacher", teacher, "--data.source", corpus, "--device", "cpu",
               "--out", d), "not an earlier `distill` output", "--overwrite true")
    assert tree(d) == before
    train = ["--backend", "torch", "--data.seq_len", "32", "--data.eval_seqs", "1", "--eval_batch_size", "1",
             "--train.batch_size", "2", "--train.tokens", "128", "--train.save_every", "1"]
    succeeds(main("distill", "--student", hybrid, "--teacher", teacher, "--data.source", corpus, "--device", "cpu",
                  *train, "--out", d, "--overwrite", "true"))  # writes among the user's files, deletes none
    assert (d / "checkpoints" / "my_model.pt").read_text() == "mine" and (d / "report.json").exists()


# --- one writer per output -------------------------------------------------------------------------------------
HOLD = ("import sys, time\n"
        "from taylor_calibrate.checks import output_lock\n"
        "with output_lock(sys.argv[1], 'convert'):\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(600)\n")


def _holder(out: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_second_writer_is_refused_naming_the_first(tw):
    """A real process holds the lock of --out: every command that writes there refuses, naming it."""
    root, teacher, corpus, hybrid = tw
    out = root / "locked"
    holder = _holder(out)
    try:
        for command, argv in _writers(root, teacher, corpus, hybrid, out).items():
            err = fails(main(*argv), "is being written by another run", f"pid {holder.pid} on ", "`convert`",
                        "pass another --out")
            assert str(root / ".locked.lock") in err, command
    finally:
        holder.kill()
        holder.wait()
    assert not out.exists()


def test_a_lock_left_by_a_killed_run_is_taken_over(tw):
    root, teacher, corpus, hybrid = tw
    out = root / "stale"
    holder = _holder(out)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = root / ".stale.lock"
    assert json.loads(lock.read_text())["pid"] == holder.pid  # left behind, its owner dead
    succeeds(cli("tokenize", "--model", teacher, "--data.source", corpus, "--out", out))
    assert (out / "tokens.json").exists() and not lock.exists()


def test_two_tokenize_runs_into_one_out_one_refused(tw):
    """Two real runs started together: one writes the shards, the other refuses naming it (or, when the first has
    finished before the second looks, reuses them): never a crash or a half-written directory."""
    root, teacher, corpus, hybrid = tw
    out = root / "together"
    argv = _cmd(["tokenize", "--model", teacher, "--data.source", corpus, "--out", out])
    ps = [subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read()) for p in ps]
    assert sorted(rc for rc, _ in results)[0] == 0, results
    for rc, log in results:
        assert "Traceback" not in log
        if rc:
            fails((rc, log), "is being written by another run")
    assert json.loads((out / "tokens.json").read_text())["tokens"]["calib"] > 0


# --- non-finite options ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--phase2.lr=.nan", "--phase2.far_weight=.nan", "--phase2.sink_weight=.inf",
                                  "--phase2.grad_clip=-.inf", "--calib.gate_alpha=.nan", "--phase2.weight_decay=.nan"])
def test_non_finite_convert_options_are_refused(tw, flag):
    root, teacher, corpus, hybrid = tw
    name = flag.split("=")[0]
    rc, log = main("convert", "--teacher", teacher, "--data.source", corpus, "--out", root / "nan", flag)
    fails((rc, log), f"{name}=-?(nan|inf) is not a finite number")
    assert "loading teacher" not in log


@pytest.mark.parametrize("flag", ["--train.lr=.nan", "--train.grad_clip=.nan", "--train.temperature=.nan",
                                  "--train.kl_weight=.nan", "--train.far_weight=.inf"])
def test_non_finite_distill_options_are_refused(tw, flag):
    root, teacher, corpus, hybrid = tw
    fails(main("distill", "--student", hybrid, "--data.source", corpus, "--out", root / "nan_d", flag),
          f"{flag.split('=')[0]}=(nan|inf) is not a finite number")


def test_non_finite_list_option_is_refused(tw):
    root, teacher, corpus, hybrid = tw
    fails(main("tradeoff", "--teacher", teacher, "--budgets", "[0.25, .nan]", "--out", root / "nan_t"), "nan")


@pytest.mark.parametrize("argv, message", [
    (["eval", "--niah_lengths", "64,128"], r"--niah_lengths '64,128' is not a list, written '\[a, b\]'"),
    (["convert", "--keep_every", "four"], "--keep_every 'four' is not an integer"),
    (["convert", "--data.seq_len", "1.5"], "--data.seq_len '1.5' is not an integer"),
    (["convert", "--kv_budget", "half"], "--kv_budget 'half' is not a number"),
    (["convert", "--align", "maybe"], "--align 'maybe' is not true or false"),
    (["convert", "--bogus", "1"], "--bogus is not an option of `convert`"),
    (["convert", "--config", "wrong_type.yaml"], "--keep_every 'four' is not an integer"),
])
def test_an_option_of_the_wrong_form_is_one_line_with_the_form(tw, argv, message):
    """jsonargparse printed its usage page, then "error: Parser key "niah_lengths":" with the reason on the next
    line, and no word of how a list is written."""
    root, teacher, corpus, hybrid = tw
    (root / "wrong_type.yaml").write_text("keep_every: four\n")
    argv = [str(root / a) if a.endswith(".yaml") else a for a in argv]
    rc, out = main(*argv, "--out", root / "wrong_form")
    fails((rc, out), message, f"see `taylor-calibrate {argv[0]} --help`")
    assert out.strip().count("\n") == 0, out  # no usage page above it
    assert not (root / "wrong_form").exists()


# --- no remote code --------------------------------------------------------------------------------------------
def _remote_code_dir(root: Path, teacher: Path, model_type: str) -> tuple[Path, Path]:
    """A copy of the teacher whose config and tokenizer config name code of the directory (auto_map); importing it
    writes a marker file."""
    d = root / f"remote_{model_type}"
    marker = root / f"ran_{model_type}"
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(teacher, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type=model_type, auto_map={"AutoConfig": "evil.EvilConfig",
                                                "AutoModelForCausalLM": "evil.EvilModel"})
    (d / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((d / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["evil.EvilTok", None]}
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                               "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilModel\n"
                               "from transformers import PreTrainedTokenizerFast as EvilTok\n")
    return d, marker


def _on_a_terminal(argv, timeout=300) -> tuple[int, str]:
    """Run argv on a pseudo-terminal, answering "y" to any question; (exit code, everything it printed)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.environ.update(ENV)
        os.execvp(argv[0], argv)
    out, deadline, status = b"", time.time() + timeout, None
    while status is None:
        if time.time() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"hung on a terminal: {out.decode(errors='replace')[-2000:]}")
        if select.select([fd], [], [], 0.5)[0]:
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            out += data
            if b"[y/N]" in out[-200:]:
                os.write(fd, b"y\n")
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(st)
    os.close(fd)
    return status, out.decode(errors="replace")


@pytest.mark.parametrize("terminal", [False, True])
def test_remote_code_is_never_run(tw, terminal):
    root, teacher, corpus, hybrid = tw
    d, marker = _remote_code_dir(root, teacher, "evil_llama")
    argv = _cmd(["convert", "--teacher", d, "--data.source", corpus, *SMALL, "--out", root / "remote_out"])
    if terminal:
        rc, log = _on_a_terminal(argv)
    else:
        r = subprocess.run(argv, env=ENV, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
        rc, log = r.returncode, r.stdout + r.stderr
    assert "[y/N]" not in log and not marker.exists()
    fails((rc, log.replace("\r", "")), "needs custom code", "never runs")


def test_an_auto_map_of_a_known_architecture_loads_the_library_class(tw):
    """An auto_map beside a model_type transformers knows: its own class loads, the directory's code does not run."""
    root, teacher, corpus, hybrid = tw
    d, marker = _remote_code_dir(root, teacher, "llama")
    rc, log = _on_a_terminal(_cmd(["eval", "--model", d, "--data.source", corpus, "--data.seq_len", "64",
                                   "--data.eval_seqs", "2", "--device", "cpu", "--backend", "torch",
                                   "--out", root / "remote_eval"]))
    assert rc == 0, log[-2000:]
    assert "[y/N]" not in log and not marker.exists()


def test_main_in_process_leaves_the_callers_sigterm_handler(tw):
    """cli.main takes SIGTERM as a Ctrl-C while it runs; a caller in the same process gets its own handler back."""
    root, teacher, corpus, hybrid = tw
    before = signal.getsignal(signal.SIGTERM)
    fails(main("convert", "--keep_every", "four", "--out", root / "sigterm_handler"), "is not an integer")
    assert signal.getsignal(signal.SIGTERM) is before


# --- inputs an audit found answered by the wrong cause ------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["convert", "--device", "gpu"], r"--device 'gpu' is not a device .* auto, cpu, cuda or cuda:N"),
    (["convert", "--data.source", ""], r"--data.source is empty; name a corpus"),
    (["convert", "--data.seq_len", "1"], r"--data.seq_len=1 is out of range \(must be >= 2\)"),
    (["damage", "--sets", "[5,17]"], r"--sets '5' is not a string \(in a list, an item holding a comma .*\"5,17\""),
    (["damage", "--windows=[5:30]"], r"--windows '330' is not a string \(in a list, an item holding a comma"),
    (["damage", "--sets", "5"], r"--sets '5' is not a list, written '\[\"a\", \"b\"\]'"),
])
def test_a_mistaken_value_names_the_option_and_the_form(tw, argv, message):
    """--device gpu was torch's list of 20 device types; an empty --data.source read the current directory as the
    corpus; a list item with a comma or colon (YAML reads 5:30 as 330) did not say how to quote it."""
    root, teacher, corpus, hybrid = tw
    fails(main(*argv, "--out", root / "mistaken"), message)
    assert not (root / "mistaken").exists()


def test_a_report_that_is_not_text_is_named(tw, tmp_path):
    binary = tmp_path / "report.json"
    binary.write_bytes(b"\x8b\x00\xff" * 10)
    fails(main("report", "--file", binary), rf"{binary} is not text")


def test_a_json_that_is_no_results_file_is_refused_by_report(tw, tmp_path):
    """`report --file` rendered any JSON object ({"foo": 1}) as a results table."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"foo": 1}))
    fails(main("report", "--file", other), rf"{other} is not a results file .*\(no commit, dirty\)")


def test_a_distill_run_given_for_its_model_names_model(tw, tmp_path):
    """`eval --model RUN` (and export, distill --student) said "no config.json; pass the output of convert"."""
    root, teacher, corpus, hybrid = tw
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "tokens": 0, "heldout_loss": 1.0, "heldout_kl": 0.1})
                                       + "\n")
    for argv in (["eval", "--model", run, "--out", tmp_path / "e"], ["export", "--model", run, "--out", tmp_path / "x"]):
        fails(main(*argv), rf"{run} is a distill run's directory; its model is {run / 'model'}")


def test_a_missing_model_leaves_no_directory_behind(tw, tmp_path, monkeypatch):
    """`eval --model smollm2-135m` (a teacher's name) made ./smollm2-135m for its default --out, and a convert that
    failed left the parents of its --out behind."""
    root, teacher, corpus, hybrid = tw
    monkeypatch.chdir(tmp_path)
    fails(main("eval", "--model", "smollm2-135m"), r"--model smollm2-135m is not a directory; .*--teacher")
    fails(main("convert", "--teacher", tmp_path / "nowhere", "--out", tmp_path / "deep" / "a" / "b"), "nowhere")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
