"""Files of ours and the user's that are damaged, odd or in the way, through the CLI (results files, model
directories, checkpoint state, token counts, tokenizer files, pipes, the token cache, seeds): each ends with exit 2
and one line naming the file or option and the fix (or, for the token cache, never writes into an input), and the
user's directories hash the same before and after. Refusals that come before any model is loaded call the CLI's
`main` in this process; a pipe that would block a reader runs in a subprocess with a deadline."""
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import VOCAB
from test_reliability import ENV, _cmd, bound_by_permissions, cli, fails, succeeds, tree
from test_reliability_inputs import SMALL, converted_world, copy_tree, main, untouched

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
    teacher, corpus, hybrid = converted_world(root)
    _, exportable = tiny_hybrid(vocab_size=VOCAB)
    save_hybrid(exportable, load_tokenizer(str(hybrid)), root / "exportable")
    return root, teacher, corpus, hybrid, root / "exportable"


@pytest.fixture(autouse=True)
def inputs_untouched(request):
    yield from untouched(request, "rw")



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
    from taylor_calibrate import results
    from taylor_calibrate.cli import COMMANDS

    writers = {name for name, (_, fn) in COMMANDS.items() if fn.__code__.co_name == "run"}  # wrapped by writes_out
    assert writers and writers <= set(results.OUTPUTS), writers - set(results.OUTPUTS)


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


# --- export reads the model directory as the loader does --------------------------------------------------------
def _config_edit(kind):
    def gdn(key, value):
        def edit(cfg):
            cfg["gdn"][key] = value
            return json.dumps(cfg)
        return edit
    return {"list": lambda cfg: "[]", "not_json": lambda cfg: '{"model_type": "taylor_hybrid",',
            "conv_size_text": gdn("conv_size", "four"), "unknown_option": gdn("conv_kernel", 4),
            "gate_bogus": gdn("gate", "relu")}[kind]


EXPORT_DAMAGE = {"list": r"config\.json is not a JSON object", "not_json": r"config\.json is not valid JSON",
                 "conv_size_text": r"config\.json is not a hybrid config .*gdn options are not valid",
                 "unknown_option": r"unknown GDN option\(s\) \['conv_kernel'\]",
                 "gate_bogus": r"gate='relu' is not one of"}


@pytest.mark.parametrize("damage", EXPORT_DAMAGE)
def test_export_of_a_damaged_config_is_one_line(rw, damage):
    """Valid JSON of the wrong shape was an AttributeError, options of the wrong type a TypeError in the model's
    constructor, invalid JSON a bare decoder message without the file."""
    root, teacher, corpus, hybrid, exportable = rw
    m = copy_tree(exportable, root / f"export_{damage}")
    (m / "config.json").write_text(_config_edit(damage)(json.loads((m / "config.json").read_text())))
    out = root / f"exported_{damage}"
    fails(main("export", "--model", m, "--out", out), EXPORT_DAMAGE[damage], "convert")
    assert not out.exists()


@pytest.mark.parametrize("command", ["export", "eval"])
def test_a_hybrid_config_with_mixer_options_of_the_wrong_type_is_named(rw, command):
    root, teacher, corpus, hybrid, _ = rw
    m = copy_tree(hybrid, root / f"opts_{command}")
    cfg = json.loads((m / "config.json").read_text())
    cfg["gdn"]["norm_eps"] = "1e-5"
    (m / "config.json").write_text(json.dumps(cfg))
    argv = {"export": ["export", "--model", m, "--out", root / "opts_out"],
            "eval": ["eval", "--model", m, "--data.source", corpus, *EVAL, "--out", root / "opts_eval_report"]}[command]
    fails(main(*argv), r"opts_\w+/config\.json is not a hybrid config .*gdn options are not valid")


def test_an_export_whose_config_is_a_pipe_is_refused_not_waited_on(rw):
    root, teacher, corpus, hybrid, exportable = rw
    m = copy_tree(exportable, root / "export_pipe")
    (m / "config.json").unlink()
    os.mkfifo(m / "config.json")
    r = subprocess.run(_cmd(["export", "--model", m, "--out", root / "exported_pipe"]), env=ENV, capture_output=True,
                       text=True, timeout=300)
    fails((r.returncode, r.stdout + r.stderr), r"config\.json is not a regular file")
    assert not (root / "exported_pipe").exists()


@pytest.mark.parametrize("heads", [{"1": "all"}, {"1": [0, 0]}, {"1": [5]}, {"1": [0, 1]}, {"2": [0]}, {}])
def test_attention_heads_of_the_wrong_shape_are_named(tmp_path, heads):
    """A head-wise hybrid's kept KV groups (attention_heads) must be distinct groups of the teacher, some but not all,
    for every head-wise layer: anything else was a TypeError deep in the model's constructor, or another model."""
    from conftest import tiny_saved_hybrid

    hybrid, _ = tiny_saved_hybrid(tmp_path)
    cfg = json.loads((hybrid / "config.json").read_text())
    assert cfg["attention_heads"] == {"1": [1], "2": [0]}
    cfg["attention_heads"] = {**cfg["attention_heads"], **heads} if heads else {}
    if heads == {"2": [0]}:
        cfg["attention_heads"] = {"2": [0]}
    (hybrid / "config.json").write_text(json.dumps(cfg))
    fails(main("export", "--model", hybrid, "--out", tmp_path / "q"), r"config\.json is not a hybrid config",
          "attention_heads")


# --- a checkpoint's state.json of the wrong shape ---------------------------------------------------------------
@pytest.fixture(scope="module")
def run(rw):
    root, teacher, corpus, hybrid, _ = rw
    out = root / "run"
    succeeds(cli("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", out))
    return out


def _newest_state(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "state.json"


STATE_DAMAGE = {
    "step_text": lambda s: s.update(step=str(s["step"])),
    "step_float": lambda s: s.update(step=float(s["step"])),
    "step_bool": lambda s: s.update(step=True),
    "groups_lr_text": lambda s: s.update(param_groups=[{**g, "lr": "x"} for g in s["param_groups"]]),
    "groups_no_params": lambda s: s.update(param_groups=[{"lr": 1e-3}]),
}


@pytest.mark.parametrize("damage", STATE_DAMAGE)
def test_a_state_json_of_the_wrong_shape_falls_back_to_the_previous_checkpoint(rw, run, damage):
    """A step that is a string or a float (it passed int() and the name check, then broke the resume with a
    TypeError), param groups that are not an optimizer's (a KeyError inside torch's set_state_dict): the newest
    checkpoint is damaged, the run resumes from the one before to the unbroken run's metrics."""
    root, teacher, corpus, hybrid, _ = rw
    o = copy_tree(run, root / f"state_{damage}")
    f = _newest_state(o)
    state = json.loads(f.read_text())
    STATE_DAMAGE[damage](state)
    f.write_text(json.dumps(state))
    log = succeeds(cli("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", o))
    assert "step_00000004 is damaged" in log and "resuming from the previous checkpoint step_00000003" in log, log[-2000:]
    steps = [json.loads(line)["step"] for line in (o / "metrics.jsonl").read_text().splitlines()]
    assert steps == [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_checkpoint_of_the_wrong_shape_is_one_line(rw, run):
    root, teacher, corpus, hybrid, _ = rw
    o = copy_tree(run, root / "state_all")
    for f in (o / "checkpoints").glob("step_*/state.json"):
        state = json.loads(f.read_text())
        state["step"] = str(state["step"])
        f.write_text(json.dumps(state))
    before = tree(o)
    fails(cli("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", o), "no usable checkpoint",
          r"records step '\d+'", "--resume false")
    assert tree(o) == before


# --- tokens.json's document counts ------------------------------------------------------------------------------
@pytest.mark.parametrize("documents", [None, {"calib": "many", "heldout": 3}, {"calib": -1, "heldout": 3}, [1, 2]])
def test_tokenize_again_over_a_tokens_json_with_damaged_document_counts(rw, documents):
    """Tokenising again into shards whose tokens.json lost its document counts was a KeyError, and counts that are not
    numbers a format error ("Cannot specify ',' with 's'."): the file is named, with the fix."""
    root, teacher, corpus, hybrid, _ = rw
    shards = root / "shards_ok"
    if not shards.exists():
        succeeds(main("tokenize", "--model", hybrid, "--data.source", corpus, "--out", shards))
    s = copy_tree(shards, root / "shards_docs")
    meta = json.loads((s / "tokens.json").read_text())
    if documents is None:
        del meta["documents"]
    else:
        meta["documents"] = documents
    (s / "tokens.json").write_text(json.dumps(meta))
    before = tree(s)
    fails(main("tokenize", "--model", hybrid, "--data.source", corpus, "--out", s),
          r"shards_docs/tokens\.json is not a token-shard description", "tokenise the corpus again")
    assert tree(s) == before


# --- tokenizer files: damaged, pipes, unreadable ----------------------------------------------------------------
def test_tokenize_with_a_model_whose_tokenizer_json_is_damaged(rw):
    """`tokenize --model` loaded the tokenizer without the loader's wrapper: a KeyError from transformers."""
    root, teacher, corpus, hybrid, _ = rw
    m = copy_tree(hybrid, root / "tok_damaged")
    (m / "tokenizer.json").write_text('{"model": 5}')
    fails(main("tokenize", "--model", m, "--data.source", corpus, "--out", root / "tok_damaged_out"),
          r"could not load the tokenizer in .*tok_damaged", "its tokenizer files are damaged", "copy them again")
    assert not (root / "tok_damaged_out").exists()


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                  "generation_config.json"])
def test_a_pipe_among_a_teachers_tokenizer_files_is_named(rw, name):
    """A pipe where the teacher's tokenizer files belong: refused naming it (the tokenizer's reader blocked on some,
    and on tokenizer.json said "download them again")."""
    root, teacher, corpus, hybrid, _ = rw
    t = copy_tree(teacher, root / f"pipe_teacher_{name.split('.')[0]}")
    (t / name).unlink(missing_ok=True)
    os.mkfifo(t / name)
    for argv in (["convert", "--teacher", t, "--data.source", corpus, *SMALL, "--out", root / "pipe_out"],
                 ["tokenize", "--model", t, "--data.source", corpus, "--out", root / "pipe_out"]):
        r = subprocess.run(_cmd(argv), env=ENV, capture_output=True, text=True, timeout=300)
        fails((r.returncode, r.stdout + r.stderr), rf"{name.replace('.', '[.]')} is not a regular file",
              "restore it from the original checkpoint")
    assert not (root / "pipe_out").exists()


def test_an_unreadable_tokenizer_file_says_permissions_not_damage(rw):
    """As a process that permission bits stop (root without its capabilities, or a user): a teacher or model whose
    tokenizer.json cannot be read is named with the fix (permissions), not "download them again"."""
    root, teacher, corpus, hybrid, _ = rw
    prefix = bound_by_permissions()
    t = copy_tree(teacher, root / "unreadable_teacher")
    m = copy_tree(hybrid, root / "unreadable_model")
    for d in (t, m):
        (d / "tokenizer.json").chmod(0o000)
    try:
        for argv in (["convert", "--teacher", t, "--data.source", corpus, *SMALL, "--out", root / "unreadable_out"],
                     ["tokenize", "--model", m, "--data.source", corpus, "--out", root / "unreadable_out"],
                     ["eval", "--model", m, "--data.source", corpus, *EVAL, "--out", root / "unreadable_out"]):
            r = subprocess.run([*prefix, *_cmd(argv)], env=ENV, capture_output=True, text=True, timeout=300)
            fails((r.returncode, r.stdout + r.stderr),
                  r"(cannot read|Permission denied:) .*unreadable_\w+/tokenizer\.json", "fix (its|the) permissions")
    finally:
        for d in (t, m):
            (d / "tokenizer.json").chmod(0o644)
    assert not (root / "unreadable_out").exists()


@pytest.mark.parametrize("command", ["tokenize", "eval"])
def test_a_tokenizer_or_model_needing_custom_code_says_it_is_never_run(rw, command):
    """The same sentence as convert and distill give, not transformers' "contains custom code which must be
    executed"; the directory's code does not run."""
    root, teacher, corpus, hybrid, _ = rw
    d = copy_tree(teacher if command == "tokenize" else hybrid, root / f"custom_{command}")
    marker = root / f"ran_{command}"
    if command == "tokenize":
        tok = json.loads((d / "tokenizer_config.json").read_text())
        tok.update(auto_map={"AutoTokenizer": ["evil.EvilTok", "evil.EvilTok"]}, tokenizer_class="EvilTok")
        (d / "tokenizer_config.json").write_text(json.dumps(tok))
        argv = ["tokenize", "--model", d, "--data.source", corpus, "--out", root / "custom_out"]
    else:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(model_type="evil_arch", auto_map={"AutoConfig": "evil.EvilConfig",
                                                     "AutoModelForCausalLM": "evil.EvilModel"})
        (d / "config.json").write_text(json.dumps(cfg))
        argv = ["eval", "--model", d, "--data.source", corpus, *EVAL, "--out", root / "custom_out"]
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                               "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilModel\n"
                               "from transformers import PreTrainedTokenizerFast as EvilTok\n")
    r = subprocess.run(_cmd(argv), env=ENV, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    fails((r.returncode, r.stdout + r.stderr), "needs custom code", "never runs")
    assert not marker.exists() and not (root / "custom_out").exists()


# --- the token cache is never written into an input -------------------------------------------------------------
def test_a_token_cache_inside_the_corpus_is_refused(rw):
    """--data.token_cache inside --data.source wrote the cache's shards and locks into the user's corpus."""
    root, teacher, corpus, hybrid, _ = rw
    for cache in (corpus, corpus / ".cache"):
        fails(main("tokenize", "--model", teacher, "--data.source", corpus, "--data.token_cache", cache,
                   "--out", root / "cache_out"), "--data.token_cache .* (is|lies inside) the --data.source directory",
              "outside it")
    assert not (root / "cache_out").exists()


def test_a_token_cache_in_the_students_teacher_is_refused(rw):
    """distill's teacher is the one the student records (no --teacher given): the cache may not go into it."""
    root, teacher, corpus, hybrid, _ = rw
    fails(main("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--data.token_cache", teacher / "c",
               "--out", root / "cache_run"), "lies inside the student's teacher directory", "--data.token_cache")
    assert not (root / "cache_run").exists()


def test_a_token_cache_from_the_environment_inside_an_input_is_named(rw):
    root, teacher, corpus, hybrid, _ = rw
    r = subprocess.run(_cmd(["tokenize", "--model", teacher, "--data.source", corpus, "--out", root / "cache_env"]),
                       env={**ENV, "TAYLOR_CALIBRATE_TOKEN_CACHE": str(teacher / "tokens")}, capture_output=True,
                       text=True, timeout=300)
    fails((r.returncode, r.stdout + r.stderr), r"\$TAYLOR_CALIBRATE_TOKEN_CACHE=.* lies inside the --model directory")
    assert not (root / "cache_env").exists()


# --- outputs linked from the token cache keep their own modes ---------------------------------------------------
def test_a_later_tokenize_under_another_umask_leaves_an_earlier_outputs_modes(rw, tmp_path):
    """Shards are hard links of the cache's files, and a link shares its file's mode: a second `tokenize` under
    umask 022 made the first one's files (written under umask 077, private) readable by everyone, and the cache's."""
    root, teacher, corpus, hybrid, _ = rw
    cache, private, shared = tmp_path / "cache", tmp_path / "private", tmp_path / "shared"

    def tokenize(out, mask):
        r = subprocess.run(_cmd(["tokenize", "--model", teacher, "--data.source", corpus, "--data.token_cache", cache,
                                 "--out", out]), env=ENV, capture_output=True, text=True, timeout=300,
                           preexec_fn=lambda: os.umask(mask))
        return succeeds((r.returncode, r.stdout + r.stderr))

    def modes(d):
        return {p.name: stat.S_IMODE(p.stat().st_mode) for p in d.iterdir()}

    tokenize(private, 0o077)
    assert set(modes(private).values()) == {0o600}
    tokenize(shared, 0o022)
    assert set(modes(shared).values()) == {0o644}
    assert set(modes(private).values()) == {0o600}, modes(private)
    entry = next(p for p in cache.iterdir() if p.name != ".locks")
    assert set(modes(entry).values()) == {0o600}, modes(entry)
    assert (shared / "calib.bin").read_bytes() == (private / "calib.bin").read_bytes()


# --- seeds ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--seed", "--phase2.seed"])
def test_a_seed_too_large_for_the_generators_is_refused_at_parse(rw, flag):
    """A seed past 64 bits failed deep in torch with "Overflow when unpacking long long", after the teacher loaded."""
    root, teacher, corpus, hybrid, _ = rw
    rc, log = main("convert", "--teacher", teacher, "--data.source", corpus, *SMALL, flag, str(2 ** 70),
                   "--out", root / "seed_out")
    fails((rc, log), rf"{flag}={2 ** 70} is out of range", "magnitude below 2\\*\\*53")
    assert "loading teacher" not in log and not (root / "seed_out").exists()


def test_seeds_of_a_tradeoff_are_checked_too(rw):
    root, teacher, corpus, hybrid, _ = rw
    fails(main("tradeoff", "--teacher", teacher, "--data.source", corpus, "--seeds", f"[0, {2 ** 64}]",
               "--out", root / "seed_t"), r"--seeds=\d+ is out of range")


# --- pipes where files of ours belong ---------------------------------------------------------------------------
def _run(argv, timeout=300):
    r = subprocess.run(_cmd(argv), env=ENV, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def _pipe(f: Path) -> None:
    if f.is_dir():
        shutil.rmtree(f)
    f.unlink(missing_ok=True)
    os.mkfifo(f)


def test_an_out_whose_report_is_a_pipe_is_not_waited_on(rw):
    """convert / eval read an existing --out's report.json to tell whether it is their earlier output: a pipe there
    blocked them for ever. It is not an output of theirs (nothing to read): refused as any foreign directory, naming
    the pipe."""
    root, teacher, corpus, hybrid, _ = rw
    o = copy_tree(hybrid, root / "out_pipe_report")
    _pipe(o / "report.json")
    fails(_run(["convert", "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", o]),
          "not an earlier `convert` output", r"its report\.json is not a regular file")
    e = root / "eval_pipe_report"
    e.mkdir(exist_ok=True)
    _pipe(e / "report.json")
    fails(_run(["eval", "--model", hybrid, "--data.source", corpus, *EVAL, "--out", e]), "not an earlier `eval` output",
          r"its report\.json is not a regular file")


def test_a_model_whose_report_is_a_pipe_is_named(rw):
    root, teacher, corpus, hybrid, _ = rw
    m = copy_tree(hybrid, root / "model_pipe_report")
    _pipe(m / "report.json")
    fails(_run(["eval", "--model", m, "--data.source", corpus, *EVAL, "--out", root / "model_pipe_eval"]),
          r"model_pipe_report/report\.json is not a regular file", "convert")


@pytest.mark.parametrize("kind", ["pipe", "directory"])
def test_a_run_whose_metrics_are_a_pipe_or_a_directory_is_named(rw, run, kind):
    root, teacher, corpus, hybrid, _ = rw
    o = copy_tree(run, root / f"metrics_{kind}")
    if kind == "pipe":
        _pipe(o / "metrics.jsonl")
    else:
        (o / "metrics.jsonl").unlink()
        (o / "metrics.jsonl").mkdir()
    fails(_run(["distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", o]),
          r"metrics\.jsonl is not a regular file", "delete it or pass a new --out")


def test_a_checkpoint_whose_state_is_a_pipe_falls_back(rw, run):
    root, teacher, corpus, hybrid, _ = rw
    o = copy_tree(run, root / "state_pipe")
    _pipe(_newest_state(o))
    log = succeeds(_run(["distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", o]))
    assert "state.json is not a regular file" in log and "resuming from the previous checkpoint step_00000003" in log


def test_token_shards_whose_description_is_a_pipe_are_named(rw):
    root, teacher, corpus, hybrid, _ = rw
    shards = root / "shards_ok"
    if not shards.exists():
        succeeds(main("tokenize", "--model", hybrid, "--data.source", corpus, "--out", shards))
    s = copy_tree(shards, root / "shards_pipe")
    _pipe(s / "tokens.json")
    fails(_run(["distill", "--student", hybrid, "--data.source", s, *TRAIN, "--out", root / "shards_pipe_run"]),
          r"shards_pipe/tokens\.json is not a regular file", "tokenise the corpus again")
    assert not (root / "shards_pipe_run").exists()


@pytest.mark.parametrize("kind", ["pipe", "directory"])
def test_a_lock_file_that_is_not_a_file_is_named(rw, kind):
    """A pipe where the lock of --out belongs was "File or stream is not seekable.", a directory a bare EISDIR."""
    root, teacher, corpus, hybrid, _ = rw
    d = root / f"lock_{kind}"
    d.mkdir(exist_ok=True)
    lock = d / ".out.lock"
    if not lock.exists():
        os.mkfifo(lock) if kind == "pipe" else lock.mkdir()
    fails(main("tokenize", "--model", teacher, "--data.source", corpus, "--out", d / "out"),
          r"the lock file .*\.out\.lock of --out .* is not a regular file", "remove it", "another --out")
    assert not (d / "out").exists() and (lock.is_dir() if kind == "directory" else lock.exists())


# --- fourth sweep: inputs a new user would hit --------------------------------------------------------------------
def _small_vocab_teacher(root: Path, teacher: Path) -> Path:
    """A teacher whose config and weights have 100 embedding rows beside the 300-token tokenizer of `teacher`."""
    import torch
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = root / "small_vocab_teacher"
    if not t.exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=100)).save_pretrained(t)
        AutoTokenizer.from_pretrained(teacher).save_pretrained(t)
    return t


def test_a_tokenizer_beyond_the_teachers_embedding_is_named(rw):
    """A teacher whose tokenizer gives ids past its embedding rows was an IndexError from torch.embedding at the first
    batch (on a GPU, a device-side assert)."""
    root, teacher, corpus, hybrid, _ = rw
    t = _small_vocab_teacher(root, teacher)
    before = tree(t)
    out = root / "small_vocab_out"
    fails(main("convert", "--teacher", t, "--data.source", corpus, *SMALL, "--out", out),
          "small_vocab_teacher: the tokenizer gives ids up to 299, but the model's embedding has 100 rows",
          "belong to another model", "copy the tokenizer files of the teacher's own checkpoint")
    assert tree(t) == before and not out.exists()


def test_a_hybrid_whose_tokenizer_outgrew_its_embedding_is_named(rw):
    from transformers import AutoTokenizer

    root, teacher, corpus, hybrid, _ = rw
    h = copy_tree(hybrid, root / "grown_tokenizer")
    tok = AutoTokenizer.from_pretrained(h)
    tok.add_tokens([f"<extra{i}>" for i in range(8)])
    tok.save_pretrained(h)
    before = tree(h)
    fails(main("eval", "--model", h, "--data.source", corpus, *EVAL, "--out", root / "grown_eval"),
          "grown_tokenizer: the tokenizer gives ids up to 307, but the model's embedding has 300 rows",
          "copy them again from the teacher")
    assert tree(h) == before and not (root / "grown_eval").exists()


@pytest.mark.parametrize("argv, flag", [
    (["ablate", "--policies", "[]"], "--policies"),
    (["ablate", "--inits", "[]"], "--inits"),
    (["tradeoff", "--budgets", "[]"], "--budgets"),
    (["tradeoff", "--policies", "[]"], "--policies"),
    (["recovery", "--policies", "[]", "--extra", "[]"], "--policies"),
])
def test_an_empty_list_of_what_to_run_is_refused_at_parse(rw, argv, flag):
    """`ablate --policies '[]'` loaded the teacher and failed with "align_layers: no mixers given"; an empty
    `--budgets` ran nothing and wrote a table of no rows. Refused at parse, naming the option."""
    root, teacher, corpus, hybrid, _ = rw
    out = root / f"empty_{argv[0]}"
    fails(main(*argv, "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", out),
          f"{flag} is empty, so there is nothing to run", "pass at least one")
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["convert", "--policy", "layers=3-1"], "layer range '3-1' in '3-1' runs backwards; write it low-high, e.g. 1-3"),
    (["damage", "--sets", '["3-1"]'], "layer range '3-1' in '3-1' runs backwards"),
    (["damage", "--sets", '["0", ","]'], r"holds a set naming no layer \(','\)"),
])
def test_a_layer_list_that_names_no_layer_is_refused(rw, argv, message):
    """`layers=3-1` was range(3, 2): no layer, so convert converted every layer and damage wrote a row for a set that
    converts nothing, as if free."""
    root, teacher, corpus, hybrid, _ = rw
    out = root / f"no_layer_{argv[0]}"
    fails(main(*argv, "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", out), message)
    assert not out.exists()


def test_tokenize_with_a_model_without_tokenizer_files_names_them(rw):
    """It was "Couldn't instantiate the backend tokenizer from one of: ..." over several lines, naming no file."""
    root, teacher, corpus, hybrid, _ = rw
    h = copy_tree(hybrid, root / "no_tokenizer")
    for f in h.glob("tokenizer*"):
        f.unlink()
    before = tree(h)
    fails(main("tokenize", "--model", h, "--data.source", corpus, "--out", root / "no_tokenizer_tokens"),
          "no_tokenizer' has no tokenizer files", "copy them from the original checkpoint")
    assert tree(h) == before and not (root / "no_tokenizer_tokens").exists()


def test_an_empty_out_is_refused_not_taken_for_the_working_directory(rw, monkeypatch):
    """`--out ''` was the working directory: "--out  holds the --model directory" where that held the teacher, and
    elsewhere a write into the directory the user stood in."""
    root, teacher, corpus, hybrid, _ = rw
    here = root / "cwd_empty_out"
    here.mkdir(exist_ok=True)
    monkeypatch.chdir(here)
    fails(main("tokenize", "--model", teacher, "--data.source", corpus, "--out", ""), "--out is empty",
          "pass a directory path")
    assert list(here.iterdir()) == []


def test_a_config_file_that_is_not_text_is_named(rw):
    """A binary --config was "'utf-8' codec can't decode byte 0xff in position 0", naming neither file nor flag."""
    root, teacher, corpus, hybrid, _ = rw
    cfg = root / "binary.yaml"
    cfg.write_bytes(b"\xff\xfe\x00garbage\x81")
    fails(main("convert", "--config", cfg, "--teacher", teacher, "--data.source", corpus, "--out", root / "bin_cfg"),
          r"--config .*binary\.yaml is not UTF-8 text", "pass a YAML file")
    assert not (root / "bin_cfg").exists()


def test_report_of_json_nested_too_deep_is_one_line(rw):
    """It was "maximum recursion depth exceeded while decoding a JSON object from a unicode string", naming no file."""
    root = rw[0]
    f = root / "deep.json"
    f.write_text('{"a":' * 5000 + "1" + "}" * 5000)
    fails(main("report", "--file", f), r"deep\.json nests JSON deeper than Python's recursion limit",
          "pass a results JSON")


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_a_token_cache_that_is_a_file_is_named(rw, where):
    """It was "[Errno 20] Not a directory: '<cache>/.locks'" once the run needed the cache, naming no option."""
    root, teacher, corpus, hybrid, _ = rw
    f = root / "cache_file"
    f.write_text("mine\n")
    cache = f if where == "file" else f / "tokens"
    what = "is a file" if where == "file" else "lies under .*cache_file, which is a file"
    fails(main("tokenize", "--model", teacher, "--data.source", corpus, "--data.token_cache", cache, "--out",
               root / f"cache_{where}_out"), f"--data.token_cache .*{what}", "pass --data.token_cache with a directory")
    assert f.read_text() == "mine\n" and not (root / f"cache_{where}_out").exists()


def test_a_damaged_save_to_disk_corpus_is_named(rw):
    """A directory with save_to_disk's marker files that datasets cannot read was the bare "Expecting property name
    enclosed in double quotes: line 1 column 2 (char 1)"."""
    root, teacher, corpus, hybrid, _ = rw
    ds = root / "damaged_dataset"
    ds.mkdir(exist_ok=True)
    (ds / "dataset_info.json").write_text("{}")
    (ds / "state.json").write_text("{garbage")
    before = tree(ds)
    fails(main("tokenize", "--model", teacher, "--data.source", ds, "--out", root / "damaged_dataset_out"),
          r"damaged_dataset' holds dataset_info\.json, state\.json as a datasets save_to_disk directory does, but "
          "datasets cannot read it", "save the dataset again")
    assert tree(ds) == before and not (root / "damaged_dataset_out").exists()


def test_distill_on_token_shards_uses_and_records_their_split(rw):
    """Shards split at heldout_fraction 0.5, distilled with --data.heldout_fraction 0.3: the option was ignored but
    recorded in report.json (and the run identity), describing rows the run never used."""
    root, teacher, corpus, hybrid, _ = rw
    shards = root / "shards_split"
    if not shards.exists():
        succeeds(main("tokenize", "--model", hybrid, "--data.source", corpus, "--out", shards))
    before = tree(shards)
    out = root / "shards_split_run"
    shutil.rmtree(out, ignore_errors=True)
    succeeds(main("distill", "--student", hybrid, "--data.source", shards, "--data.heldout_fraction", "0.3", *TRAIN,
                  "--out", out))
    report = json.loads((out / "report.json").read_text())
    assert report["args"]["data"]["heldout_fraction"] == 0.5
    state = json.loads(next((out / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["identity"]["data"]["heldout_fraction"] == 0.5
    assert tree(shards) == before
