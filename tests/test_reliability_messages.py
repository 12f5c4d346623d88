"""Messages, through the CLI: parse errors of every kind, transformers' own multi-line errors,
and too-deep or wrong-shape JSON in our own files each end with exit 2 and one line naming the option or file and the
fix; the user's directories hash the same before and after. Refusals before any model is loaded call the CLI's `main`
in this process; runs that load models are real processes."""
import json
import re
import shutil
from pathlib import Path

import pytest
from test_reliability import TRAIN, cli, fails, succeeds, tree
from test_reliability_inputs import SMALL, copy_tree, main, untouched
from test_reliability_outputs import ow as r7  # noqa: F401  (root, teacher, corpus, hybrid, a finished distill run)

EVAL = ["--data.seq_len", "64", "--data.eval_seqs", "2", "--device", "cpu", "--backend", "torch"]
DEEP = "[" * 100000 + "]" * 100000  # past Python's recursion limit: json raised RecursionError, naming no file


@pytest.fixture(autouse=True)
def inputs_untouched(request):
    yield from untouched(request, "r7")


def one_line(result, *patterns) -> str:
    """`fails`, and the error is all that was printed after the logs: no usage page, no second line of a library's
    message."""
    err = fails(result, *patterns)
    assert result[1].rstrip().splitlines()[-1] == err, result[1][-2000:]
    assert "Parser key" not in err and "<class" not in err and "pip install" not in err, err
    return err


# --- parse errors -------------------------------------------------------------------------------------------------
PARSE = [
    ([], None, r"^taylor-calibrate: error: no command given; pass one of convert, eval, "),
    (["bogus"], None, r"^taylor-calibrate: error: 'bogus' is not a command; pass one of convert"),
    (["convert", "--phase2", "3"], None, r"--phase2 '3' is not a set of options: set them one by one "
                                         r"\(--phase2\.NAME VALUE\)"),
    (["convert", "--config", "c.yaml"], "phase2: 3\n", r"--phase2 3 is not a set of options"),
    (["convert", "--config", "c.yaml"], "data: [1]\n", r"--data \[1\] is not a set of options"),
    (["convert", "--phase2.lrr", "1"], None, r"--phase2\.lrr is not an option of `convert` \(did you mean "
                                            r"--phase2\.lr\?\)"),
    (["convert", "--phase2", "{lrr: 1}"], None, r"'phase2\.lrr' \(in a group's mapping\) is not an option of "
                                                r"`convert` \(did you mean --phase2\.lr\?\)"),
    (["convert", "--config", "c.yaml"], "kep_every: 3\n", r"'kep_every' \(in --config .*c\.yaml\) is not an option "
                                                          r"of `convert` \(did you mean --keep_every\?\)"),
    (["convert", "--phase2", "{lr: x}"], None, r"--phase2\.lr 'x' is not a number"),
    (["convert", "--phase2.lr"], None, r"--phase2\.lr needs a value \(--phase2\.lr VALUE\)"),
    (["convert", "--data.seq_len="], None, r"--data\.seq_len '' is not an integer"),
    (["eval", "--lm_eval_tasks", "5"], None, r"--lm_eval_tasks '5' is not a list, written '\[a, b\]'"),
    (["convert", "--keep_every", "1", "2"], None, r"'2' follows no option: each option takes one value"),
    (["convert", "--config", "missing.yaml"], None, r"--config .*missing\.yaml does not exist; pass a YAML file"),
    (["convert", "--config", "c.yaml"], "", r"--config .*c\.yaml holds no `option: value` mapping \(it is empty\)"),
    (["convert", "--config", "c.yaml"], "- a\n", r"--config .*c\.yaml holds no `option: value` mapping"),
    (["convert", "--config", "c.yaml"], "a: [\n", r"--config .*c\.yaml is not valid YAML \(.*\); fix the file"),
    (["convert", "--print_config=bogus"], None, r"--print_config=bogus is not one of its flags"),
]


@pytest.mark.parametrize("argv, yaml, message", PARSE)
def test_every_kind_of_parse_error_is_one_line_naming_the_option(r7, argv, yaml, message):
    """jsonargparse's own wording ("Parser key "phase2": Unable to load config", "unrecognized arguments", "Unexpected
    config:", "Problems parsing config"), a TypeError traceback for a group set to a scalar in YAML, and "taylor-calibrate
    : error:" with a stray space when no command was given."""
    root = r7[0]
    cfg = root / "c.yaml"
    cfg.unlink(missing_ok=True)
    if yaml is not None:
        cfg.write_text(yaml)
    argv = [str(root / a) if a.endswith(".yaml") else a for a in argv]
    out = root / "parse_out"
    rc, log = main(*argv, *(["--out", out] if argv and argv[0] in ("convert", "eval") else []))
    one_line((rc, log), message)
    assert log.strip().count("\n") == 0, log
    assert not out.exists()


# --- transformers' multi-line errors -------------------------------------------------------------------------------
TEACHER_DAMAGE = {
    "hidden_size_text": (lambda c: {**c, "hidden_size": "64"}, r"config\.json is not a model config transformers can "
                         r"read \(Validation error for field 'hidden_size': TypeError: .*\); restore it"),
    "unknown_model_type": (lambda c: {**c, "model_type": "llamazz"}, r"unsupported teacher architecture 'llamazz' "
                           r"\(teacher .*\); pass a checkpoint of a supported one: llama"),
    "fewer_layers": (lambda c: {**c, "num_hidden_layers": 2}, r"weights for \d+ tensor\(s\) its config has no "
                     r"parameter for \(model\.layers\.2\."),
    "no_hidden_size": (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, r"weights of another shape"),
    "list": ([1, 2], r"config\.json is not a JSON object \(it holds a list\)"),
    "too_deep": (DEEP, r"config\.json nests JSON deeper than Python's recursion limit: it is damaged; restore it from"),
}


@pytest.mark.parametrize("damage", TEACHER_DAMAGE)
def test_a_teacher_config_transformers_rejects_is_one_line(r7, damage):
    """A string hidden_size, an unknown model_type: our line, then transformers' own lines (a validation report, a
    page on upgrading transformers). A config of fewer layers than the weights loaded a truncated teacher in silence,
    one without hidden_size a page of shapes ("look at the above report")."""
    root, teacher, corpus, hybrid, _ = r7
    t = copy_tree(teacher, root / f"teacher_{damage}")
    edit, pattern = TEACHER_DAMAGE[damage]
    cfg = json.loads((t / "config.json").read_text())
    (t / "config.json").write_text(edit if isinstance(edit, str) else json.dumps(edit(cfg) if callable(edit) else edit))
    before = tree(t)
    one_line(cli("convert", "--teacher", t, "--data.source", corpus, *SMALL, "--out", root / f"c_{damage}"), pattern)
    assert tree(t) == before and not (root / f"c_{damage}").exists()


HYBRID_DAMAGE = {
    "model_type_unknown": (lambda c: {**c, "model_type": "foo_bar"}, r"config\.json gives model_type 'foo_bar', which "
                           r"transformers does not know: it is damaged"),
    "model_type_missing": (lambda c: {k: v for k, v in c.items() if k != "model_type"}, r"config\.json gives no "
                           r"model_type: it is damaged"),
    "base_hidden_text": (lambda c: {**c, "base_config": {**c["base_config"], "hidden_size": "64"}},
                         r"base_config is not a config transformers can read \(.*hidden_size"),
    "base_no_vocab": (lambda c: {**c, "base_config": {k: v for k, v in c["base_config"].items() if k != "vocab_size"}},
                      r"the weights do not match its config\.json: weights of another shape"),
}


@pytest.mark.parametrize("damage", HYBRID_DAMAGE)
def test_a_hybrid_config_transformers_rejects_is_one_line(r7, damage):
    """A base_config with a string hidden_size was a StrictDataclassFieldValidationError traceback; an unknown or
    missing model_type was said to be "not a hybrid of taylor-calibrate ... pass --out" (and with --out, a page on
    upgrading transformers); a base_config without vocab_size "look at the above report"."""
    root, teacher, corpus, hybrid, _ = r7
    h = copy_tree(hybrid, root / f"hybrid_{damage}")
    edit, pattern = HYBRID_DAMAGE[damage]
    (h / "config.json").write_text(json.dumps(edit(json.loads((h / "config.json").read_text()))))
    before = tree(h)
    one_line(cli("eval", "--model", h, "--data.source", corpus, *EVAL), pattern, r"re-run `convert`|convert again")
    assert tree(h) == before


# --- too deep or wrong-shape JSON in our own files ----------------------------------------------------------------
def _deep_state(run: Path) -> str:
    for f in run.glob("checkpoints/step_*/state.json"):
        f.write_text(DEEP)
    return r"state\.json nests JSON deeper than Python's recursion limit"


def _deep_metrics(run: Path) -> str:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], DEEP, *lines[1:]]) + "\n")
    return r"metrics\.jsonl:2 nests JSON deeper than Python's recursion limit: it is damaged; delete the file or pass"


@pytest.mark.parametrize("damage", [_deep_state, _deep_metrics])
def test_a_distill_run_whose_state_is_nested_too_deep_is_one_line(r7, damage):
    """It was "maximum recursion depth exceeded while decoding a JSON array", naming no file."""
    root, teacher, corpus, hybrid, run = r7
    o = copy_tree(run, root / f"resume_{damage.__name__}")
    (o / "report.json").unlink()
    shutil.rmtree(o / "model")
    pattern = damage(o)
    before = tree(o)
    one_line(cli("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", o), pattern)
    assert tree(o) == before


@pytest.mark.parametrize("content", [DEEP, "[1, 2]"])
def test_token_shards_whose_description_is_too_deep_or_a_list_are_named(r7, content):
    root, teacher, corpus, hybrid, _ = r7
    d = root / f"shards_{len(content)}"
    shutil.rmtree(d, ignore_errors=True)
    succeeds(main("tokenize", "--model", hybrid, "--data.source", corpus, "--data.token_cache",
                  root / f"cache_{len(content)}", "--out", d))
    (d / "tokens.json").unlink()  # a link into the token cache: give the shards their own damaged copy
    (d / "tokens.json").write_text(content)
    what = "nests JSON deeper than Python's recursion limit" if content == DEEP else r"is not a JSON object"
    one_line(cli("distill", "--student", hybrid, "--data.source", d, *TRAIN, "--out", root / f"d_{len(content)}"),
             rf"tokens\.json {what}", "tokenise the corpus again")


@pytest.mark.parametrize("content", [DEEP, "[{}]"])
def test_a_recovery_out_whose_options_are_too_deep_or_a_list_is_one_line(r7, content):
    """options.json nested too deep was a RecursionError naming no file; a list a TypeError traceback in
    identity_diff."""
    root, teacher, corpus, hybrid, _ = r7
    d = root / f"recovery_{len(content)}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    (d / "options.json").write_text(content)
    (d / "recovery.json").write_text(json.dumps({"teacher_loss": 1.0, "policies": []}))
    before = tree(d)
    what = "nests JSON deeper than Python's recursion limit" if content == DEEP else r"is not a JSON object"
    one_line(cli("recovery", "--teacher", teacher, "--data.source", corpus, *SMALL, "--policies", "[uniform]",
                 "--inits", "[copy]", "--extra", "[]", "--train.tokens", "64", "--niah", "false", "--out", d),
             rf"options\.json {what}", "delete it to record this call's options, or pass a new --out")
    assert tree(d) == before


@pytest.mark.parametrize("name", ["report.json", "config.json", "generation_config.json"])
def test_a_hybrid_whose_json_is_nested_too_deep_is_one_line(r7, name):
    root, teacher, corpus, hybrid, _ = r7
    h = copy_tree(hybrid, root / f"deep_{name}")
    (h / name).write_text(DEEP)
    before = tree(h)
    one_line(cli("eval", "--model", h, "--data.source", corpus, *EVAL),
             re.escape(name) + " nests JSON deeper than Python's recursion limit: it is damaged",
             r"convert again|re-run `convert`")
    assert tree(h) == before


# --- found by the sweep ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, message", [
    (["--train.tokens", "1000000000000000000000"], r"--train\.tokens=\d+ is out of range: an integer option must be "
                                                    r"of magnitude below 2\*\*63"),
])
def test_an_integer_past_64_bits_is_refused_at_parse(r7, flag, message):
    """It was an OverflowError traceback in tqdm once the run had loaded both models."""
    root, teacher, corpus, hybrid, _ = r7
    rc, log = main("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, *flag, "--out", root / "huge")
    one_line((rc, log), message)
    assert "loading teacher" not in log and not (root / "huge").exists()


def test_a_negative_gate_alpha_is_refused(r7):
    """A negative perturbation size flipped the output gate's input: exit 0 with another model."""
    root, teacher, corpus, hybrid, _ = r7
    one_line(main("convert", "--teacher", teacher, "--data.source", corpus, "--calib.gate_alpha", "-1",
                  "--out", root / "neg_alpha"), r"--calib\.gate_alpha=-1\.0 must be >= 0")
    assert not (root / "neg_alpha").exists()


def test_report_out_under_a_file_is_one_line(r7):
    """It was "[Errno 17] File exists: '<the file>'"."""
    root, teacher, corpus, hybrid, _ = r7
    f = root / "plain_file"
    f.write_text("mine\n")
    one_line(main("report", "--file", hybrid / "report.json", "--out", f / "r.md"),
             r"--out .*plain_file/r\.md lies under .*plain_file, which is a file; pass a path in a directory")
    assert f.read_text() == "mine\n"


@pytest.mark.parametrize("command", ["tokenize", "convert"])
def test_an_unreadable_corpus_is_named_not_a_file_inside_it(tmp_path, command):
    """A corpus directory without read permission: the error names the corpus, not a tokens.json that does not exist
    inside it (run without the capabilities that let root read through permission bits)."""
    import subprocess

    from test_reliability import ENV, _cmd, bound_by_permissions

    prefix = bound_by_permissions()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text of the user's\n" * 50)
    corpus.chmod(0)
    try:
        argv = [command, "--data.source", corpus, "--out", tmp_path / "out"]
        argv += ["--device", "cpu"] if command == "convert" else []
        r = subprocess.run([*prefix, *_cmd(argv)], env=ENV, capture_output=True, text=True, timeout=600)
        one_line((r.returncode, r.stdout + r.stderr), r"corpus source .*corpus' cannot be read \(permission denied\)")
        assert "tokens.json" not in r.stderr
    finally:
        corpus.chmod(0o755)
    assert not (tmp_path / "out").exists()


def test_paths_that_misled_the_messages(tmp_path, monkeypatch):
    """`--teacher=~/t` reached us unexpanded and was read as a hub id; an empty path string as a hub id or the
    working directory; an HF directory named x.gguf, or a file named X.GGUF, took the other branch; a too-long path
    was a raw ENAMETOOLONG."""
    monkeypatch.setenv("HOME", str(tmp_path))
    o = str(tmp_path / "o")
    fails(cli("convert", "--teacher=~/missing_teacher", "--out", o),
          f"{tmp_path}/missing_teacher", "neither an HF checkpoint directory nor a .gguf file")
    fails(cli("convert", "--teacher", "", "--out", o), "--teacher is empty")
    fails(cli("convert", "--out", " "), "--out is empty")
    (tmp_path / "x.gguf").mkdir()
    fails(cli("convert", "--teacher", str(tmp_path / "x.gguf"), "--out", o), "has no config.json")
    fails(cli("convert", "--teacher", str(tmp_path / "T.GGUF"), "--out", o), "teacher GGUF file", "does not exist")
    err = fails(cli("convert", "--out", str(tmp_path / ("a" * 300))), "longer than the file system allows")
    assert "Errno" not in err and not (tmp_path / "o").exists()


def test_an_unknown_rope_type_and_shards_without_their_tokens_json_are_named(r7, tmp_path):
    """An unknown rope_scaling type was a KeyError and "download them again"; token shards whose tokens.json is gone
    were "a directory with no text files"."""
    root, teacher, corpus, hybrid, run = r7
    t = copy_tree(teacher, tmp_path / "rope_teacher")
    cfg = json.loads((t / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "weird", "factor": 2.0}
    (t / "config.json").write_text(json.dumps(cfg))
    fails(main("convert", "--teacher", t, "--data.source", corpus, *SMALL, "--out", tmp_path / "o1"),
          "rope_scaling type 'weird' is not one this transformers knows", "correct rope_scaling")
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("calib.bin", "heldout.bin"):
        (shards / name).write_bytes(b"\0" * 64)
    fails(main("convert", "--teacher", teacher, "--data.source", shards, *SMALL, "--out", tmp_path / "o2"),
          r"holds token shards \(calib\.bin, heldout\.bin\) but no tokens\.json", "tokenize")


def test_a_bad_flag_inside_tradeoff_distill_is_named_as_a_distill_flag_before_any_work():
    """`tradeoff --distill '--train.bogus 1'` was called an unknown tradeoff option, once the conversions had run."""
    err = fails(cli("tradeoff", "--distill_tokens", "1000", "--distill", '["--train.bogus 1"]'),
                r"--distill '--train\.bogus 1' \(flags of `distill`\): unrecognized arguments: --train\.bogus")
    assert "tradeoff option" not in err


def test_a_held_out_sweeps_findings(r7, tmp_path):
    """Cases a second sweep found: a batch past the token budget ran out of memory with no message; `--overwrite
    true` into a run to resume resumed in silence; every NIAH length past the model's context gave a table of "-"
    and exit 0; a too-long --out name failed on the lock file beside it; tokenize's refusal named an --overwrite it
    does not have."""
    root, teacher, corpus, hybrid, run = r7
    fails(main("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--train.batch_size", "1000000000",
               "--out", tmp_path / "big"), "less than one optimizer step", "raise --train.tokens")
    d = copy_tree(run, tmp_path / "again")
    (d / "report.json").unlink()
    fails(main("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", d, "--overwrite", "true"),
          "only with --resume false")
    fails(main("eval", "--model", hybrid, "--data.source", corpus, "--device", "cpu", "--data.seq_len", "32",
               "--data.eval_seqs", "2", "--niah", "true", "--out", tmp_path / "e"), "cannot hold a NIAH prompt",
          "run eval without --niah")  # the tiny teacher's 256 tokens: no length would do, so none is suggested
    fails(main("convert", "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", tmp_path / ("b" * 250)),
          "its last component is 250 bytes", "pass a shorter name")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    err = fails(main("tokenize", "--model", teacher, "--data.source", corpus, "--out", mine), "not an earlier")
    assert "--overwrite" not in err


def test_jsonl_records_in_a_corpus_directory_are_read_as_records(r7, tmp_path):
    """A directory of .jsonl files (or a .JSONL file) was read as raw text: calibration on JSON syntax."""
    from taylor_calibrate.config import CorpusSpec
    from taylor_calibrate.data import load_documents

    d = tmp_path / "jsonl_dir"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(json.dumps({"text": f"document {i} about rivers"}) for i in range(3)))
    (d / "b.JSONL").write_text(json.dumps({"text": "a loud record"}) + "\n")
    docs = load_documents(CorpusSpec(source=str(d)))
    texts = sorted(t for _, t in docs)
    assert texts == ["a loud record"] + [f"document {i} about rivers" for i in range(3)]


def test_a_third_sweeps_findings(r7, tmp_path):
    """A list given for an option group in --config was dropped in silence (the default corpus read instead); a model
    or teacher directory without tokenizer_config.json exported, or converted, a tokenizer without its eos; convert
    over its own earlier output replaced it without being asked."""
    root, teacher, corpus, hybrid, run = r7
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: [{corpus}, 32]\n")
    fails(main("eval", "--model", hybrid, "--config", cfg, "--out", tmp_path / "e"), "--data .* is not a set of options")
    m = copy_tree(hybrid, tmp_path / "no_tok_cfg")
    (m / "tokenizer_config.json").unlink()
    fails(main("export", "--model", m, "--out", tmp_path / "x"), "no tokenizer_config.json", "copy it again")
    fails(main("eval", "--model", m, "--data.source", corpus, "--device", "cpu", "--out", tmp_path / "e2"),
          "no tokenizer_config.json")
    t = copy_tree(teacher, tmp_path / "teacher_no_tok_cfg")
    (t / "tokenizer_config.json").unlink()
    fails(main("convert", "--teacher", t, "--data.source", corpus, *SMALL, "--out", tmp_path / "h"),
          "no tokenizer_config.json", "no eos")
    again = copy_tree(hybrid, tmp_path / "again")
    before = tree(again)
    fails(main("convert", "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", again),
          "holds an earlier `convert` output; pass --overwrite true")
    assert tree(again) == before


def test_a_renamed_weights_file_is_named(r7, tmp_path):
    """weights.safetensors in place of model.safetensors was transformers' own "no file named model.safetensors"."""
    root, teacher, corpus, hybrid, run = r7
    m = copy_tree(hybrid, tmp_path / "renamed")
    (m / "model.safetensors").rename(m / "weights.safetensors")
    fails(main("eval", "--model", m, "--data.source", corpus, "--device", "cpu", "--out", tmp_path / "e"),
          r"holds weights\.safetensors but no model\.safetensors", "rename the file")
