"""Reliability through the CLI (issue 18): every bad input and fault ends with a non-zero exit and a message that
names the problem, and nothing the user owns changes. Each case runs the CLI's `main` in this process (`python -m
taylor_calibrate` in a subprocess where a kill is the case) on real files of a tiny random Llama teacher; the teacher
directory is hashed before and after every test."""
import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_local_teacher
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--data.seq_len", "64", "--data.calib_seqs", "4", "--data.eval_seqs", "2", "--phase2.steps", "5",
         "--device", "cpu", "--backend", "torch"]
TRAIN = ["--device", "cpu", "--backend", "torch", "--data.seq_len", "32", "--data.eval_seqs", "2",
         "--eval_batch_size", "2", "--train.batch_size", "2", "--train.tokens", "256", "--train.log_every", "1",
         "--train.save_every", "1"]  # 4 steps, a checkpoint after each (the last two kept)
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _cmd(argv) -> list[str]:
    return [sys.executable, "-m", "taylor_calibrate", *map(str, argv)]


def cli(*argv) -> tuple[int, str]:
    """`taylor-calibrate *argv` in this process (a subprocess pays seconds of imports per case; the cases that need
    a real process, kills and signals, start one with `_cmd`): (exit code, what it printed and logged)."""
    from taylor_calibrate.cli import main

    buf = io.StringIO()
    handler, root = logging.StreamHandler(buf), logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)  # what the CLI logs ("loading teacher": work began) is part of what a case reads
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                rc = main([str(a) for a in argv])
            except SystemExit as e:  # a parser's own exit
                rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1  # as the interpreter maps it
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return rc, buf.getvalue()


def tree(path: Path) -> dict[str, str]:
    """sha256 of every file under `path` (hidden ones too), by relative path."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def fails(result: tuple[int, str], *patterns: str) -> str:
    """Exit code 2, one error line, each pattern in it, no traceback."""
    rc, out = result
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    err = next((l for l in out.splitlines() if "error:" in l), "")
    for p in patterns:
        assert re.search(p, err), f"{p!r} not in: {err}\n{out[-2000:]}"
    return err


def succeeds(result: tuple[int, str]) -> str:
    rc, out = result
    assert rc == 0, out[-3000:]
    return out


class World:
    """A tiny teacher (T) with its corpus, two conversions of it (A: seed 0, B: seed 1; same shapes, other weights),
    and a finished distillation of B (run_b), all made once for the module."""

    def __init__(self, root: Path):
        self.root = root
        self.teacher, self.corpus = tiny_local_teacher(root)
        self.a, self.b, self.run_b = root / "A", root / "B", root / "run_b"
        succeeds(self.convert(self.a))
        succeeds(self.convert(self.b, "--seed", "1"))
        succeeds(self.distill(self.b, self.run_b))
        self.teacher_hash = tree(self.teacher)

    def convert(self, out, *more, teacher=None):
        return cli("convert", "--teacher", teacher or self.teacher, "--data.source", self.corpus, *SMALL, "--out", out,
                   *more)

    def distill(self, student, out, *more):
        return cli("distill", "--student", student, "--out", out, "--data.source", self.corpus, *TRAIN, *more)

    def eval(self, model, *more):
        return cli("eval", "--model", model, "--data.source", self.corpus, "--data.seq_len", "64",
                   "--data.eval_seqs", "2", "--device", "cpu", "--backend", "torch", *more)

    def copy(self, src: Path, name: str) -> Path:
        dst = self.root / "copies" / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        return dst


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    return World(tmp_path_factory.mktemp("reliability"))


@pytest.fixture(autouse=True)
def teacher_untouched(request):
    """Whatever a case does, the teacher's files stay byte for byte what they were."""
    yield
    if "w" in request.fixturenames:
        world = request.getfixturevalue("w")
        assert tree(world.teacher) == world.teacher_hash


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def _clobber(d: Path, tensor: str = "model.layers.1.self_attn.q_proj.weight", nbytes: int = 4096) -> None:
    """Overwrite `nbytes` of one tensor's data in the weights file with 0xFF bytes (NaN in float32)."""
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    start = 8 + n + json.loads(data[8:8 + n])[tensor]["data_offsets"][0]
    data[start:start + nbytes] = b"\xff" * nbytes
    f.write_bytes(bytes(data))


# --- data loss -------------------------------------------------------------------------------------------------
def test_convert_into_the_teacher_or_its_parent_is_refused(w):
    fails(w.convert(w.teacher), r"--out .* is the --teacher directory")
    fails(w.convert(w.teacher.parent, "--overwrite", "true"), r"--out .* holds the --teacher directory")


def test_distill_into_its_own_student_is_refused(w):
    s = w.copy(w.a, "own_student")
    before = tree(s)
    fails(w.distill(s, s), r"--out .* is the --student directory")
    assert tree(s) == before


def test_convert_killed_while_replacing_an_earlier_output_leaves_it_whole(w):
    """SIGKILL while the new output is being written (its temporary sibling exists): the earlier output is intact
    and loads; a complete rerun replaces it by one rename, byte-identical, with nothing left beside it."""
    x = w.copy(w.a, "earlier")
    before = tree(x)
    argv = ["convert", "--teacher", w.teacher, "--data.source", w.corpus, *SMALL, "--out", x, "--overwrite", "true"]
    p = subprocess.Popen(_cmd(argv), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while p.poll() is None and time.time() < deadline and not list(x.parent.glob(".earlier.partial-*")):
        time.sleep(0.001)
    p.send_signal(signal.SIGKILL)
    p.wait()
    now = tree(x)
    assert now["model.safetensors"] == before["model.safetensors"] and now["config.json"] == before["config.json"]
    succeeds(w.eval(x, "--out", w.root / "copies" / "earlier_eval"))
    succeeds(w.convert(x, "--overwrite", "true"))
    assert tree(x)["model.safetensors"] == before["model.safetensors"]  # deterministic, and replaced whole
    assert not [q.name for q in x.parent.iterdir() if q.name.startswith(".earlier.")]


def test_a_directory_mixing_two_conversions_is_refused_by_every_reader(w):
    missing = w.copy(w.a, "missing_gate")  # weights of a conversion without g_proj under a config with it
    sd = _weights(missing)
    save_file({k: v for k, v in sd.items() if ".g_proj." not in k}, str(missing / "model.safetensors"),
              metadata={"format": "pt"})
    fails(w.eval(missing), r"no weights \(model\.layers\.1\.self_attn\.g_proj\.weight")
    fails(w.distill(missing, w.root / "copies" / "d_missing"), "no weights", "incomplete or mixes")
    assert not (missing / "eval").exists()

    disagree = w.copy(w.a, "report_disagrees")  # report.json of another conversion
    rep = json.loads((disagree / "report.json").read_text())
    rep["layer_types"] = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
    (disagree / "report.json").write_text(json.dumps(rep))
    fails(w.eval(disagree), "report.json and config.json describe different models")

    from transformers import AutoModelForCausalLM

    import taylor_calibrate  # noqa: F401
    with pytest.raises(ValueError, match="no weights"):
        AutoModelForCausalLM.from_pretrained(missing)
    with pytest.raises(ValueError, match="describe different models"):
        AutoModelForCausalLM.from_pretrained(disagree)


def test_export_refuses_a_damaged_source_and_a_bad_out(w):
    missing = w.copy(w.a, "export_missing")
    sd = _weights(missing)
    save_file({k: v for k, v in sd.items() if ".g_proj." not in k}, str(missing / "model.safetensors"),
              metadata={"format": "pt"})
    fails(cli("export", "--model", missing, "--out", w.root / "copies" / "ex1"), "no weights", "incomplete or mixes")
    nan = w.copy(w.a, "export_nan")
    _clobber(nan)
    fails(cli("export", "--model", nan, "--out", w.root / "copies" / "ex2"), r"non-finite weights: 1024 NaN/inf")
    fails(cli("export", "--model", w.a, "--out", w.a), r"--out .* is the --model directory")
    assert not (w.root / "copies" / "ex1").exists() and not (w.root / "copies" / "ex2").exists()


def test_distill_refuses_to_resume_another_run(w):
    """--out holds B's finished run: distilling A there (same shapes) or B with other arguments is refused, with the
    difference named; the run's files do not change."""
    o = w.copy(w.run_b, "run_b")
    before = tree(o)
    fails(w.distill(w.a, o), "another run", "student's initial weights")
    fails(w.distill(w.b, o, "--train.lr", "1e-2"), "another run", r"train\.lr: 0\.001 then, 0\.01 now")
    assert tree(o) == before


# --- silent wrong results --------------------------------------------------------------------------------------
def test_non_positive_norm_eps_is_refused_up_front(w):
    out = w.root / "copies" / "eps"
    fails(w.convert(out, "--gdn.norm_eps", "-1"), r"norm_eps=-1\.0 must be > 0")
    assert not out.exists()


def test_eval_of_damaged_weights_fails_naming_the_tensor(w):
    m = w.copy(w.a, "clobbered")
    _clobber(m)
    fails(w.eval(m), r"non-finite weights: 1024 NaN/inf values in model\.layers\.1\.self_attn\.q_proj\.weight "
                     r"\(layer 1\)")
    assert not (m / "eval").exists()


def test_eval_of_overflowing_weights_fails_on_the_perplexity(w):
    m = w.copy(w.a, "overflow")
    sd = _weights(m)
    sd["lm_head.weight"] = sd["lm_head.weight"] * 1e37  # finite, but the logits overflow
    save_file(sd, str(m / "model.safetensors"), metadata={"format": "pt"})
    fails(w.eval(m), r"perplexity is (nan|inf)")
    assert not (m / "eval").exists()


def test_distill_of_a_non_finite_student_names_the_tensor(w):
    m = w.copy(w.a, "nan_student")
    _clobber(m)
    out = w.root / "copies" / "d_nan"
    fails(w.distill(m, out), r"non-finite weights: 1024 NaN/inf values in model\.layers\.1\.self_attn\.q_proj")
    assert not out.exists()


def test_distill_whose_loss_diverges_fails_naming_the_step(w):
    out = w.root / "copies" / "d_diverge"
    fails(w.distill(w.a, out, "--train.lr", "1e30", "--train.grad_clip", "0"), r"at step \d+", "--train.lr")
    assert not (out / "model").exists() and not (out / "report.json").exists()


def test_alignment_divergence_is_reported_and_the_saved_model_is_finite(w):
    out = w.root / "copies" / "diverged_align"
    log = succeeds(w.convert(out, "--phase2.lr", "1e30", "--phase2.lr_qkv", "1e30", "--phase2.lr_dynamics", "1e30",
                             "--phase2.log_every", "1"))
    assert re.search(r"note: phase 2 diverged in layer \d at step \d+", log)
    assert all(torch.isfinite(v).all() for v in _weights(out).values())


def test_seq_len_beyond_the_teachers_context_is_refused(w):
    fails(w.convert(w.root / "copies" / "long", "--data.seq_len", "512"),
          "max_position_embeddings 256", "--data.beyond_context")


def test_jsonl_text_field_of_numbers_is_refused(w):
    f = w.root / "copies" / "numbers.jsonl"
    f.parent.mkdir(exist_ok=True)
    f.write_text("".join(json.dumps({"text": i, "body": "w"}) + "\n" for i in range(20)))
    fails(w.convert(w.root / "copies" / "num", "--data.source", f), r"numbers\.jsonl:1", "holds a int",
          "--data.text_field")


# --- --out checked before any work -----------------------------------------------------------------------------
def _no_work(err_and_log):
    rc, log = err_and_log
    assert "loading teacher" not in log and "Loading weights" not in log, log[-2000:]
    return rc, log


@pytest.mark.parametrize("command", ["convert", "distill", "eval"])
def test_out_that_is_a_file_fails_before_any_work(w, command):
    f = w.root / "copies" / f"file_{command}"
    f.parent.mkdir(exist_ok=True)
    f.write_text("mine\n")
    run = {"convert": lambda: w.convert(f), "distill": lambda: w.distill(w.a, f),
           "eval": lambda: w.eval(w.a, "--out", f)}
    fails(_no_work(run[command]()), "is an existing file")
    assert f.read_text() == "mine\n"


def test_out_under_a_file_fails_before_any_work(w):
    f = w.root / "copies" / "plain_file"
    f.parent.mkdir(exist_ok=True)
    f.write_text("mine\n")
    fails(_no_work(w.convert(f / "sub")), "lies under .*plain_file, which is a file")


def bound_by_permissions() -> list[str]:
    """The command prefix under which permission bits stop a process: none for a user; for root, setpriv dropping
    every capability (root reads and writes through the bits). Skips the test, saying why, where root has no setpriv."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: permission bits do not stop root, so this case cannot be made")
    return ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]


def test_unwritable_out_fails_before_any_work(w):
    """A place nobody can write (/proc), and a directory whose permission bits forbid writing."""
    fails(_no_work(w.convert(Path("/proc/taylor-calibrate-out"))), "cannot write in /proc")
    prefix = bound_by_permissions()
    ro = w.root / "copies" / "readonly"
    ro.mkdir(parents=True, exist_ok=True)
    ro.chmod(0o500)
    try:
        argv = ["convert", "--teacher", w.teacher, "--data.source", w.corpus, *SMALL, "--out", ro / "out"]
        r = subprocess.run([*prefix, *_cmd(argv)], env=ENV, capture_output=True, text=True, timeout=600)
        fails(_no_work((r.returncode, r.stdout + r.stderr)), r"cannot write in .*readonly \(Permission denied\)")
    finally:
        ro.chmod(0o700)
    assert not (ro / "out").exists()


def test_non_empty_foreign_out_needs_overwrite(w):
    """eval writes among a user's files with --overwrite true; convert, which replaces --out whole, is refused with
    or without it (it deleted the directory), naming what is there."""
    d = w.root / "copies" / "my_stuff"
    d.mkdir(parents=True, exist_ok=True)
    (d / "notes.txt").write_text("mine\n")
    fails(_no_work(w.convert(d)), "not an earlier `convert` output", "notes.txt")
    fails(_no_work(w.convert(d, "--overwrite", "true")), "not an earlier `convert` output", "whatever --overwrite")
    fails(_no_work(w.distill(w.a, d)), "not an earlier `distill` output")
    fails(_no_work(w.eval(w.a, "--out", d)), "not an earlier `eval` output")
    assert tree(d) == {"notes.txt": hashlib.sha256(b"mine\n").hexdigest()}
    succeeds(w.eval(w.a, "--out", d, "--overwrite", "true"))
    assert (d / "notes.txt").read_text() == "mine\n" and (d / "report.json").exists()


# --- damaged inputs: clear errors, no tracebacks ---------------------------------------------------------------
def test_truncated_gguf_teacher(w):
    from taylor_calibrate.teacher import embedded_teacher_path
    try:
        gguf = embedded_teacher_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cut = w.root / "copies" / "cut.gguf"
    cut.parent.mkdir(exist_ok=True)
    with open(gguf, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    fails(w.convert(w.root / "copies" / "g", teacher=cut), r"GGUF file .*cut\.gguf.* is truncated")


def test_truncated_teacher_weights(w):
    t = w.copy(w.teacher, "t_truncated")
    f = t / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    fails(w.convert(w.root / "copies" / "tt", teacher=t), r"t_truncated/model\.safetensors is corrupt or truncated")


def test_teacher_without_tokenizer_files(w):
    t = w.copy(w.teacher, "t_notok")
    for f in t.glob("tokenizer*"):
        f.unlink()
    fails(w.convert(w.root / "copies" / "nt", teacher=t), "has no tokenizer files", "copy them")


def test_teacher_with_a_bad_config(w):
    t = w.copy(w.teacher, "t_badcfg")
    (t / "config.json").write_text("{not json")
    fails(w.convert(w.root / "copies" / "bc", teacher=t), r"t_badcfg/config\.json is not valid JSON")
    (t / "config.json").write_text('{"hidden_size": 64}')
    err = fails(w.convert(w.root / "copies" / "bc", teacher=t), "config.json is not a model config")
    assert "hub" not in err


def test_latin1_jsonl_names_the_file(w):
    f = w.root / "copies" / "latin1.jsonl"
    f.parent.mkdir(exist_ok=True)
    f.write_bytes("".join(json.dumps({"text": "caf\u00e9 " * 50}, ensure_ascii=False) + "\n"
                          for _ in range(20)).encode("latin-1"))
    fails(w.convert(w.root / "copies" / "l1", "--data.source", f), r"latin1\.jsonl is not UTF-8 \(line 1", "iconv")


@pytest.mark.parametrize("command", ["convert", "distill", "eval"])
def test_eval_batch_size_zero(w, command):
    run = {"convert": lambda: w.convert(w.root / "copies" / "b0", "--eval_batch_size", "0"),
           "distill": lambda: w.distill(w.a, w.root / "copies" / "b0", "--eval_batch_size", "0"),
           "eval": lambda: w.eval(w.a, "--eval_batch_size", "0")}
    fails(run[command](), "--eval_batch_size 0 must be >= 1")


# --- checkpoints -----------------------------------------------------------------------------------------------
def _newest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step_*"))[-1]


@pytest.mark.parametrize("damage", ["state.json", "model.safetensors"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(w, damage):
    """The last two checkpoints are kept: a damaged newest one (garbage state.json, junk weights) is reported and
    the run resumes from the one before, to the same weights and the same metrics as the unbroken run."""
    o = w.copy(w.run_b, f"fallback_{damage}")
    assert [c.name for c in sorted((o / "checkpoints").glob("step_*"))] == ["step_00000003", "step_00000004"]
    (_newest(o) / damage).write_bytes(b"\x00garbage{")
    log = succeeds(w.distill(w.b, o))
    assert "step_00000004 is damaged" in log and "resuming from the previous checkpoint step_00000003" in log
    a, b = _weights(w.run_b / "model"), _weights(o / "model")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    ref = [json.loads(l) for l in (w.run_b / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(l) for l in (o / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in got] == [r["step"] for r in ref]


def test_no_usable_checkpoint_is_a_clear_error(w):
    o = w.copy(w.run_b, "all_damaged")
    for c in (o / "checkpoints").glob("step_*"):
        (c / "state.json").write_text("garbage")
    fails(w.distill(w.b, o), "no usable checkpoint", "damaged", "--resume false")


def test_half_written_metrics_line_is_dropped_on_resume(w):
    o = w.copy(w.run_b, "half_line")
    with open(o / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "tokens": 3')  # a kill mid-write
    log = succeeds(w.distill(w.b, o))
    assert "dropped a half-written last line" in log
    recs = [json.loads(l) for l in (o / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [json.loads(l)["step"] for l in
                                         (w.run_b / "metrics.jsonl").read_text().splitlines()]


# --- messages and help -----------------------------------------------------------------------------------------
def test_error_messages_name_real_flags():
    """Every --flag the package's messages mention is an option of some subcommand (pip's, torchrun's and the git
    call of the results recorder aside)."""
    from taylor_calibrate.cli import build_parser
    parser = build_parser()
    real = {"--help", "--config", "--nproc_per_node", "--porcelain"}  # torchrun's, git's
    for sub in parser._subcommands_action.choices.values():
        for action in sub._actions:
            real.update(action.option_strings)
    named = set()
    for f in (ROOT / "taylor_calibrate").rglob("*.py"):
        named.update(re.findall(r"(?<![\w-])--[a-z][a-z0-9_.]*[a-z0-9](?![\w-])", f.read_text()))
    assert named and not sorted(named - real), sorted(named - real)


def test_lm_eval_include_is_documented_as_trusted_input_only():
    rc, out = cli("eval", "--help")
    assert rc == 0
    text = " ".join(out.split())
    assert re.search(r"--lm_eval_include.*Trusted input only.*runs code from DIR", text), text
