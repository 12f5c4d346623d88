"""Whose output an --out holds, through the CLI: an earlier output is recognised by the content of the files its
command writes (a user's directory holding files or folders of the same names is refused, untouched, and --overwrite
true never writes over one of them), and a distill run started over an earlier one needs --overwrite true, which
deletes that output as the run starts, so the directory never mixes two runs; a distill model/ is complete once its
report.json, written last, stands beside it."""
import json
import shutil
from pathlib import Path

import pytest
from test_reliability import fails, succeeds, tree
from test_reliability_inputs import SMALL, converted_world, copy_tree, main, untouched

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
    yield from untouched(request, "ow")



def _distill(ow, out, *more):
    root, teacher, corpus, hybrid, run = ow
    return main("distill", "--student", hybrid, "--data.source", corpus, *TRAIN, "--out", out, *more)


# --- a distill run over an earlier one ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["resume_false", "no_checkpoints"])
def test_a_new_run_over_a_finished_one_needs_overwrite(ow, case):
    """--resume false (or nothing left to resume from) over another run's model/ and report.json: the old files stayed
    until the new run ended, so a crash left a report describing a model being replaced. Refused before any work."""
    root = ow[0]
    d = copy_tree(ow[4], root / f"finished_{case}")
    if case == "no_checkpoints":
        shutil.rmtree(d / "checkpoints")
    before = tree(d)
    more = ["--resume", "false"] if case == "resume_false" else []
    why = "--resume false starts a new run there" if case == "resume_false" else "holds no checkpoint to resume from"
    fails(_distill(ow, d, *more), "holds an earlier distill run's output", why, "--overwrite true to replace it")
    assert tree(d) == before


def test_a_run_stopped_before_its_first_checkpoint_starts_over_with_the_same_command(ow):
    """Ctrl-C in a run's first steps left only its step-0 metrics; the same command again (which the interrupt line
    says resumes) was refused: "holds no checkpoint to resume from; pass --overwrite true". Nothing trained is lost by
    starting over, so it does; one run's records result."""
    root = ow[0]
    d = copy_tree(ow[4], root / "stopped_early")
    shutil.rmtree(d / "checkpoints")
    shutil.rmtree(d / "model")
    (d / "report.json").unlink()
    first = (d / "metrics.jsonl").read_text().splitlines()[0]
    (d / "metrics.jsonl").write_text(first + "\n")
    succeeds(_distill(ow, d))
    steps = [json.loads(line)["step"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps.count(0) == 1, steps
    assert json.loads((d / "report.json").read_text())["resumed_from"] is None and (d / "model").is_dir()


def test_resuming_after_the_corpus_changed_at_the_same_path_is_refused(ow):
    """The run identity held the corpus's path, not what it holds: a document edited between a stop and the same
    command again resumed on other rows (re-tokenised), and metrics.jsonl joined two held-out sets in one curve."""
    root, teacher, corpus, hybrid, run = ow
    c = copy_tree(corpus, root / "changing_corpus")
    d = root / "changing_run"
    shutil.rmtree(d, ignore_errors=True)
    succeeds(main("distill", "--student", hybrid, "--data.source", c, *TRAIN, "--out", d))
    (d / "report.json").unlink()
    shutil.rmtree(d / "model")
    (c / "doc03.txt").write_text("completely different words now " * 40)
    before = tree(d)
    fails(main("distill", "--student", hybrid, "--data.source", c, *TRAIN, "--out", d),
          r"holds checkpoints of another run, which differs in: data\.rows\.tokens\.calib: \d+ then, \d+ now "
          r"\(the corpus changed since\)", "pass a new --out")
    assert tree(d) == before


def test_overwrite_deletes_the_earlier_run_as_it_starts_so_a_crash_leaves_no_mix(ow):
    """With --overwrite true the earlier run's report.json, model/, metrics and checkpoints go as the run starts: a
    new run that fails midway (a diverging loss) leaves none of them beside its own files; one that finishes leaves
    only its own; a user's file in the directory stays."""
    root = ow[0]
    d = copy_tree(ow[4], root / "replaced")
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
    d = copy_tree(ow[4], ow[0] / "again")
    succeeds(_distill(ow, d))
    assert json.loads((d / "report.json").read_text())["resumed_from"] == 4


# --- a user's file of a name a command writes ---------------------------------------------------------------------
USERS = [("distill", "model"), ("distill", "report.json"), ("distill", "metrics.jsonl"),
         ("distill", "checkpoints/step_00000001"), ("eval", "report.json"), ("eval", "niah_answers.jsonl"),
         ("ablate", "ablation.json"), ("ablate", "ablation.md"), ("damage", "damage.json"), ("damage", "damage.md"),
         ("tradeoff", "tradeoff.json"), ("tradeoff", "tradeoff.png"), ("tradeoff", "e2e_heads_0.25_0_0"),
         ("recovery", "recovery.json"), ("recovery", "recovery.md"), ("recovery", "runs/uniform__copy")]


def _argv(ow, command, out):
    root, teacher, corpus, hybrid, run = ow
    data = ["--data.source", corpus, "--device", "cpu"]
    argv = {"distill": ["distill", "--student", hybrid, *TRAIN, "--data.source", corpus],
            "eval": ["eval", "--model", hybrid, *data, "--data.seq_len", "32", "--data.eval_seqs", "2"],
            "tokenize": ["tokenize", "--model", teacher, "--data.source", corpus]}.get(command,
                                                                                       [command, "--teacher", teacher,
                                                                                        *data])
    return [*argv, "--out", out]


@pytest.mark.parametrize("command,name", USERS, ids=[f"{c}-{n}" for c, n in USERS])
def test_overwrite_never_replaces_a_users_file_of_a_name_the_command_writes(ow, command, name):
    """--overwrite true writes a command's files among a user's: their report.json, damage.md, tradeoff.png,
    model/ folder, a run directory recovery trains in (its checkpoints deleted), ... was replaced. Refused before any
    work, naming the file and the fix, untouched; one check (results.OUTPUTS) for every command."""
    d = ow[0] / f"users_{command}_{name.replace('/', '_')}"
    shutil.rmtree(d, ignore_errors=True)
    (d / name).parent.mkdir(parents=True)
    (d / "notes.txt").write_text("mine\n")
    if "." not in Path(name).name or name.startswith("e2e"):  # a folder of theirs
        (d / name).mkdir()
        (d / name / "weights.bin").write_bytes(b"mine")
    else:
        (d / name).write_text('{"mine": 1}\n')
    before = tree(d)
    fails(main(*_argv(ow, command, d), "--overwrite", "true"),
          rf"holds a {name} that is not an earlier `{command}` output's", "pass another --out", rf"or move {name} away")
    assert tree(d) == before


def test_overwrite_writes_among_a_users_other_files(ow):
    """What --overwrite true is for: eval into a directory of the user's whose names it does not write; their files
    stay as they were."""
    d = ow[0] / "users_other_files"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    (d / "notes.txt").write_text("mine\n")
    (d / "report.md").write_text("mine\n")
    before = tree(d)
    succeeds(main(*_argv(ow, "eval", d), "--overwrite", "true"))
    assert json.loads((d / "report.json").read_text())["model_ppl"] > 0
    assert {k: v for k, v in tree(d).items() if k != "report.json"} == before


def test_a_huge_json_file_is_not_read_whole_nor_taken_for_ours(ow):
    """Whether a file is a command's own was decided by reading it whole: a user's multi-megabyte report.json holding
    eval's keys was read into memory, taken for an earlier eval output and replaced without --overwrite. Past the cap
    (results._MARK_BYTES) a file is not ours: refused without --overwrite, and with it, untouched."""
    from taylor_calibrate import results

    d = ow[0] / "huge_report"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    assert results._MARK_BYTES < 5 << 20
    (d / "report.json").write_text(json.dumps({"model": "mine", "model_ppl": 1.0, "pad": "x" * (5 << 20)}))
    before = tree(d)
    fails(main(*_argv(ow, "eval", d)), "not an earlier `eval` output", "pass a new or empty directory")
    fails(main(*_argv(ow, "eval", d), "--overwrite", "true"), "holds a report.json that is not an earlier `eval`")
    assert tree(d) == before


# --- recovery's refusals name what recovery accepts -------------------------------------------------------------
def test_recovery_run_again_with_other_options_is_refused(ow):
    """recovery reuses its finished runs, mixers and students by name: run again into the same --out with other
    options, it mixed settings in one recovery.json (and a run in progress was refused with distill's fix,
    "--resume false", which recovery lacks). The first call records its options; another is refused naming what
    differs, before any work; the same command with another time limit continues."""
    root, teacher, corpus, hybrid, run = ow
    d = root / "recovery_restart"
    shutil.rmtree(d, ignore_errors=True)
    argv = [*_argv(ow, "recovery", d), "--keep_every", "2", "--profile", "quick", "--backend", "torch",
            "--data.seq_len", "32", "--data.calib_seqs", "4", "--data.eval_seqs", "2", "--eval_batch_size", "2",
            "--train.tokens", "256", "--train.batch_size", "2", "--policies", "[uniform]", "--inits", "[copy]",
            "--extra", "[]", "--niah", "false"]
    succeeds(main(*argv, "--time_limit_s", "0"))  # stops after its first step, checkpointed
    run_dir = d / "runs" / "uniform__copy"
    assert any((run_dir / "checkpoints").glob("step_*")) and not (run_dir / "result.json").exists()
    before = tree(d)
    err = fails(main(*argv, "--train.lr", "1e-2"), "holds a recovery experiment run with other options", r"train\.lr",
                "pass those options again to continue it, or a new --out")
    assert "--resume" not in err and "--overwrite" not in err
    assert tree(d) == before
    succeeds(main(*argv))  # the same options, no time limit: continues and finishes
    assert json.loads((d / "recovery.json").read_text())["complete"]


# --- distill's model/ and report.json: complete or not at all ---------------------------------------------------
def test_a_model_without_its_report_is_incomplete_and_resuming_finishes_it(ow, monkeypatch):
    """distill writes model/ then report.json: a run stopped between the two left a complete-looking model/ that eval
    and export read as the run's result. The report, written last, marks it complete: without it the model is
    refused naming the fix (run the command again), and running it again resumes and writes both."""
    from taylor_calibrate import distill

    root, teacher, corpus, hybrid, run = ow
    d = copy_tree(run, root / "stopped_before_report")
    shutil.rmtree(d / "checkpoints" / "step_00000004")  # resumes from step 3: a run that trains again (a finished
    # one run again trains nothing and keeps its report until it rewrites it)

    def stop(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(distill, "record", stop)  # killed after model/, before report.json
        rc, log = _distill(ow, d)
    assert rc == 130, log[-2000:]
    assert (d / "model" / "model.safetensors").exists() and not (d / "report.json").exists()
    before = tree(d)
    for argv in (["eval", "--model", d / "model", "--data.source", corpus, "--device", "cpu", "--out", root / "ev"],
                 ["export", "--model", d / "model", "--out", root / "ex"]):
        fails(main(*argv), rf"{d / 'model'} is the model of the distill run in {d}, which has not finished",
              "report.json, written last, is missing", "run that distill command again to finish it")
    assert tree(d) == before and not (root / "ev").exists() and not (root / "ex").exists()
    succeeds(_distill(ow, d))
    assert json.loads((d / "report.json").read_text())["resumed_from"] == 4
    succeeds(main("eval", "--model", d / "model", "--data.source", corpus, "--device", "cpu", "--data.seq_len", "32",
                  "--data.eval_seqs", "2", "--out", root / "ev"))


def test_a_resumed_run_removes_the_earlier_stops_report_and_model_first(ow, monkeypatch):
    """A resumed run kept the earlier stop's report.json and model/ until it ended: one killed midway left an old
    report beside newer checkpoints. Resuming removes them first (report.json before model/); the run's end writes
    both again."""
    from taylor_calibrate import distill

    root, teacher, corpus, hybrid, run = ow
    d = copy_tree(run, root / "resumed_then_killed")
    shutil.rmtree(d / "checkpoints" / "step_00000004")  # resumes from step 3 (the run keeps two) and trains step 4
    (d / "notes.txt").write_text("mine\n")

    def killed(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(distill, "save_checkpoint", killed)  # killed at its first checkpoint after resuming
        rc, log = _distill(ow, d)
    assert rc == 130, log[-2000:]
    assert not (d / "report.json").exists() and not (d / "model").exists()
    assert sorted(p.name for p in (d / "checkpoints").glob("step_*")) == ["step_00000003"]
    assert (d / "notes.txt").read_text() == "mine\n"
    succeeds(_distill(ow, d))
    assert json.loads((d / "report.json").read_text())["resumed_from"] == 3 and (d / "model").is_dir()


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
    fails(main(*_argv(ow, command, d)), f"not an earlier `{command}` output", "pass a new or empty directory")
    assert tree(d) == before


def test_a_corpus_holding_a_tokens_json_is_read_as_a_corpus(ow):
    """A corpus directory of the user's with a tokens.json of its own was taken for token shards: convert refused it
    as shards, distill called it damaged and said to delete it. Read as the corpus it is, untouched."""
    root, teacher, corpus, hybrid, run = ow
    c = copy_tree(corpus, root / "corpus_with_tokens_json")
    (c / "tokens.json").write_text('{"tokens": ["river", "stone"], "note": "my word list"}')
    before = tree(c)
    out = root / "shards_of_corpus_with_tokens_json"
    succeeds(main("tokenize", "--model", teacher, "--data.source", c, "--out", out))
    assert json.loads((out / "tokens.json").read_text())["documents"]["calib"] > 0 and tree(c) == before


def test_a_finished_run_run_again_keeps_its_result_if_it_fails(ow, monkeypatch):
    """Running a finished distill command again trains nothing: its report.json and model/ stay as they were, so a
    failure on the way (here: writing the report) leaves the finished result, not a model without its report."""
    from taylor_calibrate import distill

    root, teacher, corpus, hybrid, run = ow
    d = copy_tree(run, root / "finished_again")
    report = (d / "report.json").read_bytes()

    def stop(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(distill, "record", stop)
        rc, log = _distill(ow, d)
    assert rc == 130, log[-2000:]
    assert (d / "report.json").read_bytes() == report and (d / "model" / "model.safetensors").exists()


def test_eval_of_a_distill_runs_model_reports_beside_it(ow):
    """eval's default --out for a distill run's model/ was <run>/model/eval, which the run replaces whole when it is
    run again; it is <run>/eval, which survives that."""
    root, teacher, corpus, hybrid, run = ow
    d = copy_tree(run, root / "evaluated_run")
    succeeds(main("eval", "--model", d / "model", "--data.source", corpus, "--device", "cpu", "--data.seq_len", "32",
                  "--data.eval_seqs", "2"))
    assert (d / "eval" / "report.json").is_file() and not (d / "model" / "eval").exists()
    report = (d / "eval" / "report.json").read_bytes()
    shutil.rmtree(d / "checkpoints" / "step_00000004")  # the run trains its last step again: model/ is replaced
    succeeds(_distill(ow, d))
    assert (d / "eval" / "report.json").read_bytes() == report


@pytest.mark.parametrize("flag,value,differs", [("--data.eval_seqs", "1", r"data\.heldout_rows: 2 then, 1 now"),
                                                 ("--dtype", "bfloat16", r"data\.dtype: 'float32' then, 'bfloat16' now")])
def test_a_resume_that_would_change_what_the_run_measures_is_refused(ow, flag, value, differs):
    """A stopped distill resumed with another --data.eval_seqs (its held-out curve then mixes two row sets under one
    recorded value) or --dtype (weights unlike an uninterrupted run's) was accepted. Refused, naming the option."""
    root, teacher, corpus, hybrid, run = ow
    d = root / f"resume_other_{flag.strip('-').replace('.', '_')}"
    shutil.rmtree(d, ignore_errors=True)
    succeeds(_distill(ow, d))
    (d / "report.json").unlink()
    shutil.rmtree(d / "model")
    before = tree(d)
    fails(_distill(ow, d, flag, value), "holds checkpoints of another run, which differs in: .*" + differs)
    assert tree(d) == before


# --- convert replaces --out whole: only an earlier output of its own, holding nothing else ----------------------
def _convert(ow, out, *more):
    root, teacher, corpus, hybrid, run = ow
    return main("convert", "--teacher", teacher, "--data.source", corpus, *SMALL, "--out", out, *more)


@pytest.mark.parametrize("what", ["git_project", "distill_run", "convert_output_with_notes"])
def test_convert_never_deletes_what_it_did_not_write(ow, what):
    """`convert --overwrite true` deleted all of --out: a project with its .git, a finished distill run (which
    convert's own message advised it for), a user's notes beside a converted model. Refused with and without the
    flag, naming what is there, the directory byte-identical; an earlier output holding only its own files is
    replaced."""
    root, teacher, corpus, hybrid, run = ow
    d = root / f"replace_{what}"
    shutil.rmtree(d, ignore_errors=True)
    if what == "git_project":
        (d / ".git" / "refs").mkdir(parents=True)
        (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
        (d / "train.py").write_text("print('mine')\n")
        named = r"\.git, train\.py"
    elif what == "distill_run":
        copy_tree(run, d)
        named = "checkpoints"
    else:
        copy_tree(hybrid, d)
        (d / "notes.txt").write_text("mine\n")
        named = r"also holds notes\.txt"
    before = tree(d)
    for more in ([], ["--overwrite", "true"]):
        fails(_convert(ow, d, *more), named, "pass a new or empty directory|move it away")
        assert tree(d) == before
    if what == "convert_output_with_notes":
        (d / "notes.txt").unlink()
        fails(_convert(ow, d), "holds an earlier `convert` output; pass --overwrite true to replace it")
        succeeds(_convert(ow, d, "--overwrite", "true"))
        report = json.loads((d / "report.json").read_text())
        assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()) == report["files"]


def test_convert_through_a_link_keeps_the_link(ow):
    """`--out link` (a link to a directory) renamed the link to a hidden .link.old-<pid> and put a real directory in
    its place, the target keeping the old model. The link stays and the directory it leads to takes the output."""
    root = ow[0]
    target, link = root / "link_target", root / "link_out"
    shutil.rmtree(target, ignore_errors=True)
    link.unlink(missing_ok=True)
    target.mkdir()
    link.symlink_to(target, target_is_directory=True)
    for more in ([], ["--overwrite", "true"]):  # into the empty target, then over the earlier output through the link
        succeeds(_convert(ow, link, *more))
        assert link.is_symlink() and (target / "report.json").is_file() and (target / "model.safetensors").is_file()
        assert not [p.name for p in root.iterdir() if p.name.startswith((".link_out", ".link_target"))
                    and not p.name.endswith(".lock")]


@pytest.mark.parametrize("out", [".", "..", "ABS"])
def test_the_working_directory_and_its_parents_are_refused_before_any_work(ow, out, monkeypatch):
    """`--out .` ran the whole conversion, then failed on the rename and left a complete ..partial-<pid>/ behind."""
    root, teacher, corpus, hybrid, run = ow
    here = root / "cwd_case" / "inner"
    here.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(here)
    before = tree(root / "cwd_case")
    res = _convert(ow, str(here) if out == "ABS" else out)
    fails(res, "working directory", "pass a new directory")
    assert tree(root / "cwd_case") == before and "loading teacher" not in res[1] and "Loading weights" not in res[1]
    fails(main(*_argv(ow, "eval", out if out != "ABS" else str(here))), "working directory")


def test_a_model_whose_tokenizer_was_replaced_is_refused_by_its_readers(ow, tmp_path):
    """A hybrid's tokenizer files replaced by another tokenizer of the same size: eval exited 0 with another
    perplexity (and with --teacher blamed the teacher). convert records its tokenizer; readers refuse another."""
    from transformers import AutoTokenizer

    root, teacher, corpus, hybrid, run = ow
    d = copy_tree(hybrid, tmp_path / "swapped")
    tok = AutoTokenizer.from_pretrained(d)
    vocab = tok.get_vocab()
    a, b = sorted(vocab, key=vocab.get)[-2:]  # two ordinary tokens trade ids: same size, other encoding
    data = json.loads((d / "tokenizer.json").read_text())
    v = data["model"]["vocab"]
    v[a], v[b] = v[b], v[a]
    (d / "tokenizer.json").write_text(json.dumps(data))
    fails(main("eval", "--model", d, "--data.source", corpus, "--device", "cpu", "--data.seq_len", "32",
               "--data.eval_seqs", "2", "--out", tmp_path / "e"),
          "its tokenizer files are not the tokenizer it was converted with", "copy them again")
    assert not (tmp_path / "e").exists()
    (d / "report.json").unlink()  # the record is the model's config (a distilled model/ has no report.json)
    fails(main("eval", "--model", d, "--data.source", corpus, "--device", "cpu", "--data.seq_len", "32",
               "--data.eval_seqs", "2", "--out", tmp_path / "e"), "its tokenizer files are not the tokenizer")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("tokenizer_fingerprint")
    (d / "config.json").write_text(json.dumps(cfg))  # nothing recorded: the teacher it names is not blamed
    fails(main("eval", "--model", d, "--teacher", teacher, "--data.source", corpus, "--device", "cpu",
               "--data.seq_len", "32", "--data.eval_seqs", "2", "--out", tmp_path / "e"),
          "tokenizer files do not match its teacher", "copy them again from the teacher")
