"""Reliability, second round (issue 40), through the CLI: a full disk and Ctrl-C end in one line with nothing left
half-written; damaged files of ours (valid JSON of the wrong shape, shards beyond the vocabulary, a config that lost
its GDN options) are named with the fix; a teacher with another vocabulary is refused by `eval` as by `distill`;
outputs are as readable as the umask says."""
import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_local_teacher, tiny_tokenizer
from test_reliability import ENV, _cmd, cli, fails, succeeds, tree
from test_reliability_inputs import SMALL, copy_tree, main

EVAL = ["--data.seq_len", "64", "--data.eval_seqs", "2", "--device", "cpu", "--backend", "torch"]

FULL_DISK = ("import sys, safetensors.torch, transformers.modeling_utils as mu\n"
             "from safetensors import SafetensorError\n"
             "def full(*a, **k):\n"
             "    raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)'\n"
             "                          ' IoError(Os { code: 28, kind: StorageFull })')\n"
             "safetensors.torch.save_file = mu.safe_save_file = full\n"
             "import taylor_calibrate.distill as d; d.save_file = full\n"
             "from taylor_calibrate.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")


@pytest.fixture(scope="module")
def fw(tmp_path_factory):
    root = tmp_path_factory.mktemp("failures")
    teacher, corpus = tiny_local_teacher(root)
    hybrid = root / "hybrid"
    old = os.umask(0o022)
    try:
        succeeds(cli("convert", "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", hybrid))
    finally:
        os.umask(old)
    return root, teacher, corpus, hybrid


def _full_disk(*argv) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-c", FULL_DISK, *map(str, argv)], env=ENV, capture_output=True, text=True,
                       timeout=600)
    return r.returncode, r.stdout + r.stderr


def test_a_full_disk_during_convert_is_one_line_and_leaves_nothing(fw):
    root, teacher, corpus, hybrid = fw
    out = root / "full_convert"
    fails(_full_disk("convert", "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", out),
          "could not write .*full_convert", "no space left on the device", "free space")
    assert not out.exists() and not [p for p in root.iterdir() if p.name.startswith(".full_convert")]


def test_a_full_disk_while_distill_checkpoints_is_one_line_and_leaves_nothing(fw):
    root, teacher, corpus, hybrid = fw
    out = root / "full_distill"
    fails(_full_disk("distill", "--student", hybrid, "--data.source", corpus, "--device", "cpu", "--backend",
                     "torch", "--data.seq_len", "32", "--data.eval_seqs", "2", "--eval_batch_size", "2",
                     "--train.batch_size", "2", "--train.tokens", "128", "--train.save_every", "1", "--out", out),
          r"could not write .*checkpoints/step_\d+", "no space left")
    assert not list((out / "checkpoints").glob("*")) if (out / "checkpoints").exists() else True


def _as_from_a_shell() -> None:
    """The child starts with SIGINT at its default, as a command typed in a shell does. A child inherits an ignored
    SIGINT (POSIX: a non-interactive shell starts its background jobs so, e.g. this suite run with `... &`), and
    Python then never raises KeyboardInterrupt: the Ctrl-C under test would not arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_ctrl_c_and_sigterm_are_one_line(fw, sig, code):
    """A SIGTERM (`kill`, a scheduler's time limit) or SIGHUP (the terminal closed) ended the process on the spot: no
    line, and no cleanup of what a run had staged. Each signal now ends in one line and leaves nothing."""
    root, teacher, corpus, hybrid = fw
    out = root / f"interrupted_{sig.name}"
    p = subprocess.Popen(_cmd(["convert", "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", out]),
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         preexec_fn=_as_from_a_shell)
    log = ""
    deadline = time.time() + 300
    while "loading teacher" not in log and time.time() < deadline:
        log += p.stdout.readline()
    p.send_signal(sig)
    log += p.stdout.read()
    assert p.wait() == code, log[-2000:]
    assert "Traceback" not in log and "interrupted" in log
    assert not out.exists() and not [q for q in root.iterdir() if q.name.startswith(f".{out.name}")]


@pytest.mark.parametrize("sig, codes, what", [(signal.SIGINT, (-signal.SIGINT, 130), "interrupted"),
                                              (signal.SIGTERM, (143,), "terminated"),
                                              (signal.SIGHUP, (129,), "hung up")])
def test_a_signal_while_the_cli_is_still_importing_is_one_line(sig, codes, what):
    """Before cli.main runs (torch and transformers take seconds to import) a Ctrl-C or a SIGTERM is one line too
    (a SIGTERM was a silent kill)."""
    p = subprocess.Popen(_cmd(["convert", "--help"]), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_as_from_a_shell)
    time.sleep(1.0)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode in codes, err[-2000:]
    assert "Traceback" not in err and err.strip() == f"taylor-calibrate: {what} while starting; nothing was written"


# --- damaged files of ours -------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["[]", '{"layer_types": 3}', '{"args": [1]}'])
def test_a_report_of_the_wrong_shape_is_named(fw, content):
    root, teacher, corpus, hybrid = fw
    m = copy_tree(hybrid, root / "bad_report")
    (m / "report.json").write_text(content)
    fails(main("eval", "--model", m, "--data.source", corpus, *EVAL), r"bad_report/report\.json is not a conversion "
          "report", "convert again")


def test_a_config_that_lost_its_gdn_options_is_refused(fw):
    root, teacher, corpus, hybrid = fw
    m = copy_tree(hybrid, root / "no_gdn")
    cfg = json.loads((m / "config.json").read_text())
    del cfg["gdn"]
    (m / "config.json").write_text(json.dumps(cfg))
    fails(main("eval", "--model", m, "--data.source", corpus, *EVAL), r"does not give the gdn option\(s\) \[",
          "report.json's args.gdn")
    (m / "report.json").unlink()
    fails(main("eval", "--model", m, "--data.source", corpus, *EVAL), "gdn option", "convert again")


def _set(key, value):
    return lambda cfg: cfg.update({key: value})


CONFIG_DAMAGE = {  # config.json / other JSON files of a hybrid, valid JSON of the wrong shape -> what the error names
    "gdn_layers": (_set("gdn_layers", "x"), r"config\.json is not a hybrid config .*sets \['gdn_layers'\]"),
    "layer_types_null": (_set("layer_types", None), r"config\.json .*layer_types is not a list of layer kinds"),
    "layer_types_short": (lambda c: c.update(layer_types=c["layer_types"][:2]), r"layer_types lists 2 layers where "
                          r"base_config\.num_hidden_layers is 4"),
    "base_layers": (lambda c: c["base_config"].update(num_hidden_layers=3), "layer_types lists 4 layers where"),
    "teacher_name": (_set("teacher_name", 5), "teacher_name is of type int, not str"),
    "gdn_list": (_set("gdn", [1, 2]), r"gdn \(the mixer's options\) is of type list"),
    "generation_config": ("generation_config.json", r"generation_config\.json is not a JSON object"),
    "tokenizer_config": ("tokenizer_config.json", r"tokenizer_config\.json is not a JSON object"),
    "tokenizer_json": ("tokenizer.json", r"could not load the tokenizer in .*its tokenizer files are damaged"),
}


@pytest.mark.parametrize("damage", CONFIG_DAMAGE)
def test_a_hybrid_config_of_the_wrong_shape_is_named(fw, damage):
    """Each would otherwise load another model than the one saved, or fail deep in transformers with a traceback."""
    root, teacher, corpus, hybrid = fw
    edit, pattern = CONFIG_DAMAGE[damage]
    m = copy_tree(hybrid, root / f"cfg_{damage}")
    if callable(edit):
        cfg = json.loads((m / "config.json").read_text())
        edit(cfg)
        (m / "config.json").write_text(json.dumps(cfg))
    else:
        (m / edit).write_text('{"model": 5}' if edit == "tokenizer.json" else "[]")
    fails(main("eval", "--model", m, "--data.source", corpus, *EVAL), pattern)


@pytest.mark.parametrize("damage", ["shape", "corpus_list", "truncated", "beyond_vocab"])
def test_damaged_token_shards_are_named(fw, damage):
    root, teacher, corpus, hybrid = fw
    shards = root / "shards"
    if not shards.exists():
        succeeds(main("tokenize", "--model", hybrid, "--data.source", corpus, "--out", shards))
    d = copy_tree(shards, root / f"shards_{damage}")
    if damage in ("shape", "corpus_list"):
        meta = json.loads((d / "tokens.json").read_text())
        (d / "tokens.json").write_text(json.dumps({**meta, "corpus": [1]} if damage == "corpus_list" else
                                                  {"tokens": [1, 2]}))
        pattern = "is not a token-shard description"
    elif damage == "truncated":
        f = d / "calib.bin"
        f.write_bytes(f.read_bytes()[:100])
        pattern = "holds 100 bytes where tokens.json records"
    else:
        meta = json.loads((d / "tokens.json").read_text())
        ids = np.memmap(d / "calib.bin", dtype=meta["dtype"], mode="r+")
        ids[5] = 9999
        ids.flush()
        del ids
        pattern = "holds id 9999, beyond the tokenizer's"
    fails(main("distill", "--student", hybrid, "--data.source", d, "--device", "cpu", "--backend", "torch",
               "--data.seq_len", "32", "--data.eval_seqs", "2", "--train.tokens", "64", "--out", root / f"d_{damage}"),
          pattern, "tokenise the corpus again")


def test_metrics_and_state_of_the_wrong_shape_are_named(tmp_path):
    from taylor_calibrate.distill import CorruptCheckpoint, _records, read_checkpoint

    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2 is not a metrics record"):
        _records(m)
    m.write_text('{"step": 0, "heldout_kl": "x"}\n{"step": 1}\n')  # a resumed run compares and exps these
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1 is not a metrics record"):
        _records(m)
    ck = tmp_path / "step_00000001"
    ck.mkdir()
    (ck / "state.json").write_text("[1]")
    with pytest.raises(CorruptCheckpoint, match="step_00000001 is damaged"):
        read_checkpoint(ck, None)
    (ck / "state.json").write_text('{"step": 99999}')  # would resume a finished run from a step it never reached
    with pytest.raises(CorruptCheckpoint, match="records step 99999, not the step of step_00000001"):
        read_checkpoint(ck, None)


# --- inputs against what they claim ----------------------------------------------------------------------------
def test_eval_refuses_a_teacher_with_another_vocabulary(fw):
    root, teacher, corpus, hybrid = fw
    other = copy_tree(teacher, root / "other_vocab")
    for f in other.glob("tokenizer*"):
        f.unlink()
    tiny_tokenizer([p.read_text().upper() for p in sorted(corpus.iterdir())]).save_pretrained(other)
    out = root / "ev_other"
    fails(main("eval", "--model", hybrid, "--teacher", other, "--agreement", "true", "--data.source", corpus, *EVAL,
               "--out", out), "does not share the model's vocabulary", "pass the teacher it was converted from")
    assert not (out / "report.json").exists()


def test_convert_records_the_teacher_path_absolute(fw):
    root, teacher, corpus, hybrid = fw
    assert json.loads((hybrid / "config.json").read_text())["teacher_name"] == str(teacher.resolve())


def test_distill_checks_its_teacher_against_the_one_converted_from(fw, caplog):
    """convert records a hash of the teacher's weights; distill warns toward another --teacher (allowed: a model of
    the same vocabulary), not toward a copy of the same one, and refuses the recorded teacher once the model at that
    path changed; a resume toward it names the change."""
    import torch
    from safetensors.torch import load_file, save_file

    from taylor_calibrate.distill import identity_diff, run_identity
    from taylor_calibrate.config import TrainArgs
    from taylor_calibrate.teacher import teacher_hash

    root, teacher, corpus, hybrid = fw
    recorded = json.loads((hybrid / "report.json").read_text())["teacher_hash"]
    assert recorded == teacher_hash(str(teacher)) and recorded.startswith("sha256:")
    moved = copy_tree(teacher, root / "teacher_moved")
    student = copy_tree(hybrid, root / "student_of_moved")
    cfg = json.loads((student / "config.json").read_text())
    (student / "config.json").write_text(json.dumps({**cfg, "teacher_name": str(moved)}))
    # --data.seq_len past the context: each run stops right after the teacher check, before any work
    distill = ["distill", "--student", student, "--data.source", corpus, "--device", "cpu", "--data.seq_len", "4096"]
    fails(main(*distill, "--out", root / "d_same", "--teacher", teacher), "longer than the student's context")
    assert "not the teacher" not in caplog.text  # a copy of the same weights is the same teacher
    identity = run_identity(torch.nn.Linear(1, 1), set(), str(moved), TrainArgs())
    weights = load_file(str(moved / "model.safetensors"))
    save_file({k: v + 0.01 for k, v in weights.items()}, str(moved / "model.safetensors"), metadata={"format": "pt"})
    fails(main(*distill, "--out", root / "d_changed"), "is no longer the model it was converted from",
          "its weights changed since", f"pass --teacher {moved}")
    fails(main(*distill, "--out", root / "d_explicit", "--teacher", moved), "longer than the student's context")
    assert f"--teacher {moved} is not the teacher" in caplog.text and "whose weights changed since" in caplog.text
    diffs = identity_diff(identity, run_identity(torch.nn.Linear(1, 1), set(), str(moved), TrainArgs()))
    assert diffs and "the teacher's weights" in diffs[0]
    assert not (root / "d_changed").exists()
    shutil.rmtree(moved)
    fails(main(*distill, "--out", root / "d_gone"), f"the teacher {moved} that .* records does not exist any more",
          "pass --teacher with where it is now")


def test_the_hash_of_large_weights_samples_them_and_still_tells_them_apart(tmp_path, monkeypatch):
    """Past FULL_HASH_BYTES the hash reads samples (a multi-GB teacher is not read whole): a copy elsewhere hashes
    the same, a change in a sampled block does not."""
    from taylor_calibrate import teacher as t

    gguf = tmp_path / "a" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(np.random.default_rng(0).bytes(5 << 20))
    assert t.teacher_hash(str(gguf)).startswith("sha256:")
    monkeypatch.setattr(t, "FULL_HASH_BYTES", 1 << 20)
    sampled = t.teacher_hash(str(gguf))
    assert sampled.startswith("sha256-sampled:")
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(gguf, copy)
    assert t.teacher_hash(str(copy)) == sampled
    with open(copy, "r+b") as f:  # the last MiB is always read
        f.seek((5 << 20) - 100)
        f.write(b"\x00" * 8)
    assert t.teacher_hash(str(copy)) != sampled


def test_hidden_weight_needs_a_teacher_of_the_students_depth_and_width(fw):
    """--train.hidden_weight pairs each student layer with the teacher's: a wider or deeper teacher (same vocabulary,
    so allowed for the KL) is refused by name, not a torch shape error or a silent pairing of the first layers."""
    import torch
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM

    root, teacher, corpus, hybrid = fw
    wide = root / "teacher_wide"
    if not wide.exists():
        shutil.copytree(teacher, wide)
        torch.manual_seed(0)
        cfg = tiny_config("llama", vocab_size=json.loads((teacher / "config.json").read_text())["vocab_size"],
                          hidden_size=96, head_dim=24, num_hidden_layers=6)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(wide)
    fails(main("distill", "--student", hybrid, "--teacher", wide, "--train.hidden_weight", "1", "--data.source", corpus,
               "--device", "cpu", "--data.seq_len", "32", "--out", root / "d_wide"),
          "has 6 layers of width 96 and the student 4 of width 64", "--train.hidden_weight 0")


def test_tokenize_again_after_the_corpus_changed_rebuilds(fw):
    root, teacher, corpus, hybrid = fw
    c = copy_tree(corpus, root / "corpus_changing")
    out = root / "tok_changing"
    succeeds(main("tokenize", "--model", hybrid, "--data.source", c, "--out", out))
    first = json.loads((out / "tokens.json").read_text())
    assert first["corpus"]["path"] == str(c) and first["corpus"]["files"] == len(list(c.iterdir()))
    (c / "new.txt").write_text("the river runs under old bridges. " * 40)
    succeeds(main("tokenize", "--model", hybrid, "--data.source", c, "--out", out))
    second = json.loads((out / "tokens.json").read_text())
    assert second["corpus"]["sha1"] != first["corpus"]["sha1"]
    assert sum(second["tokens"].values()) > sum(first["tokens"].values())
    from taylor_calibrate.data import CorpusSpec, write_tokens
    from taylor_calibrate.teacher import load_tokenizer
    (c / "new.txt").write_text("changed again")
    with pytest.raises(ValueError, match="it changed since"):
        write_tokens(CorpusSpec(source=str(c)), load_tokenizer(str(hybrid)), out)


# --- permissions -----------------------------------------------------------------------------------------------
def test_outputs_are_readable_as_the_umask_says(fw):
    root, teacher, corpus, hybrid = fw
    assert stat.S_IMODE(hybrid.stat().st_mode) == 0o755
    assert stat.S_IMODE((hybrid / "report.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((hybrid / "model.safetensors").stat().st_mode) == 0o644


def test_export_of_a_headwise_hybrid_is_refused(tmp_path):
    from conftest import tiny_saved_hybrid

    hybrid, _ = tiny_saved_hybrid(tmp_path)
    before = tree(hybrid)
    out = tmp_path / "exported"
    fails(main("export", "--model", hybrid, "--out", out), "is a head-wise hybrid", "--target qwen3_5")
    assert not out.exists() and tree(hybrid) == before


def _unprivileged() -> list[str] | None:
    """The command prefix that runs a process as a user whom permission bits stop: none needed for a user, setpriv
    to nobody for root (who writes through them); None when there is no setpriv."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if shutil.which("setpriv") else None


PERMISSION_RUNS = """
import sys
from taylor_calibrate.cli import main
for argv in sys.argv[1:]:
    print("=== rc", main(argv.split("|")), file=sys.stderr, flush=True)
"""


def test_what_cannot_be_written_or_read_is_one_line_naming_the_place_and_the_fix(fw):
    """As a user (not root): an --out whose parent is not writable, a writable --out inside a directory that is not
    (the lock and staged outputs go beside --out), and a teacher whose weights cannot be read: each fails with exit 2,
    one line naming the place and the fix (not "corrupt"), no traceback, nothing written."""
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("running as root without `setpriv` to drop to an unprivileged user")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="taylor-calibrate-perm-"))  # outside pytest's root-only tmp directory
    try:
        (base / "ro" / "out_kept").mkdir(parents=True)
        (base / "ro" / "out_kept").chmod(0o777)
        (base / "w").mkdir()
        (base / "w").chmod(0o777)
        shutil.copytree(fw[1], base / "teacher")
        for p in (base / "teacher").iterdir():
            p.chmod(0o000 if p.name == "model.safetensors" else 0o644)
        for d in (base, base / "ro", base / "teacher"):
            d.chmod(0o555 if d.name == "ro" else 0o755)
        before = sorted(p.name for p in (base / "ro").rglob("*"))
        runs = [f"convert|--out|{base / 'ro' / 'new'}", f"tokenize|--out|{base / 'ro' / 'out_kept'}",
                f"convert|--teacher|{base / 'teacher'}|--device|cpu|--out|{base / 'w' / 'o'}"]
        r = subprocess.run([*prefix, sys.executable, "-c", PERMISSION_RUNS, *runs], capture_output=True, text=True,
                           timeout=300, env={**ENV, "HOME": str(base)}, cwd=base)
        out = r.stdout + r.stderr
        if prefix and "=== rc" not in out:  # nobody cannot run this interpreter or read the package
            pytest.skip(f"the CLI does not start as an unprivileged user here: {out.strip()[-300:]}")
        assert "Traceback" not in out and out.count("=== rc 2") == 3, out[-3000:]
        errors = [line for line in out.splitlines() if " error: " in line]
        assert len(errors) == 3, out[-3000:]
        assert f"cannot write in {base / 'ro'} (Permission denied)" in errors[0] and "pass a writable" in errors[0]
        assert f"cannot write in {base / 'ro'} (Permission denied), where the run keeps its lock" in errors[1]
        assert f"cannot read {base / 'teacher' / 'model.safetensors'} (Permission denied); fix its permissions" \
            in errors[2]
        assert sorted(p.name for p in (base / "ro").rglob("*")) == before and not (base / "w" / "o").exists()
    finally:
        (base / "ro").chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at `path` (root only): a disk that really fills up."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_disk_that_really_fills_up_is_one_line_and_leaves_nothing(fw, tmp_path):
    """On a small tmpfs: the token shards and the GGUF (numpy's short writes), eval's report (a bare ENOSPC) and the
    lock file each fail with one line saying the disk is full and the fix; nothing is left on it."""
    from conftest import VOCAB
    from test_export_qwen3_5 import tiny_hybrid

    from taylor_calibrate.checkpoint import save_hybrid
    from taylor_calibrate.teacher import load_tokenizer

    root, teacher, corpus, hybrid = fw
    big = tmp_path / "big"
    big.mkdir()
    for i in range(20):
        (big / f"d{i}.txt").write_text(" ".join(f"the river {i} runs under old bridges {j}." for j in range(400)))
    _, exportable = tiny_hybrid(vocab_size=VOCAB)
    save_hybrid(exportable, load_tokenizer(str(hybrid)), tmp_path / "exportable")
    cases = [("64k", 0, ["tokenize", "--model", hybrid, "--data.source", big, "--out"]),
             ("64k", 0, ["export", "--model", tmp_path / "exportable", "--format", "gguf", "--out"]),
             ("8k", 4096, ["eval", "--model", hybrid, "--data.source", corpus, *EVAL, "--out"]),
             ("4k", 4096, ["eval", "--model", hybrid, "--data.source", corpus, *EVAL, "--out"])]
    for size, pad, argv in cases:
        with _tmpfs(tmp_path / "disk", size) as disk:
            (disk / "pad").write_bytes(b"\0" * pad)
            err = fails(main(*argv, disk / "out"), "[Nn]o space left on", "free space")
            assert [p.name for p in disk.iterdir()] == ["pad"], (err, list(disk.rglob("*")))


def test_a_teacher_whose_config_changed_since_the_conversion_is_refused(fw, tmp_path):
    """A teacher's config.json edited in place after the conversion (a norm's eps) was distilled toward in silence:
    the recorded hash covered its weights only."""
    root, teacher, corpus, hybrid = fw
    moved = copy_tree(teacher, tmp_path / "teacher")
    student = copy_tree(hybrid, tmp_path / "student")
    cfg = json.loads((student / "config.json").read_text())
    (student / "config.json").write_text(json.dumps({**cfg, "teacher_name": str(moved)}))
    tcfg = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**tcfg, "rms_norm_eps": 0.5}))
    fails(main("distill", "--student", student, "--data.source", corpus, "--device", "cpu", "--data.seq_len", "4096",
               "--out", tmp_path / "d"), "is no longer the model it was converted from", "its config.json changed")
