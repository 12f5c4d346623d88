"""Profiles: YAML dumps of the arguments they set, read into the argument dataclasses; `auto` resolved once, logged
and recorded."""
import logging
from dataclasses import fields

import pytest
import torch

from taylor_calibrate.config import (NIAH_NEW_TOKENS, PROFILE_DIR, PROFILES, AlignArgs, ConvertArgs, DataArgs,
                                     DistillArgs, EvalArgs, NiahArgs, RecoveryArgs, TradeoffArgs, TrainArgs,
                                     apply_profile, apply_train_profile, load_profile)


def test_profiles_are_the_shipped_yaml_files_and_name_only_real_options():
    assert sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")) == sorted(PROFILES)
    for name in PROFILES:
        prof = load_profile(name)
        assert set(prof) == {"data", "phase2", "train"}
        for section, cls in (("data", DataArgs), ("phase2", AlignArgs), ("train", TrainArgs)):
            known = {f.name for f in fields(cls)}
            assert set(prof[section]) <= known, f"{name}.yaml {section}: {set(prof[section]) - known}"
            cls(**prof[section])  # the values pass the dataclass's own checks


def test_auto_resolves_once_logs_and_records_the_profile(caplog):
    args = ConvertArgs()
    with caplog.at_level(logging.INFO, logger="taylor_calibrate"):
        assert apply_profile(args, "cpu") == "quick"
    assert "profile auto -> quick" in caplog.text
    assert args.profile == "quick"  # results record the resolved name
    quick = load_profile("quick")
    assert (args.data.seq_len, args.data.calib_seqs, args.data.eval_seqs) == tuple(quick["data"].values())
    assert (args.phase2.steps, args.phase2.batch_size, args.phase2.seq_len, args.phase2.lr_qkv) == \
        tuple(quick["phase2"].values())
    assert apply_profile(ConvertArgs(), "cuda") == "full"


def test_a_profile_fills_only_unset_options():
    args = ConvertArgs(profile="full", data=DataArgs(seq_len=64), phase2=AlignArgs(steps=7))
    apply_profile(args, "cpu")
    assert args.data.seq_len == 64 and args.phase2.steps == 7
    assert args.data.calib_seqs == load_profile("full")["data"]["calib_seqs"]
    d = DistillArgs(profile="quick", train=TrainArgs(tokens=100))
    apply_train_profile(d.train, apply_profile(d, "cpu"))
    assert d.train.tokens == 100 and d.train.batch_size == load_profile("quick")["train"]["batch_size"]


def test_unknown_profile_is_an_error():
    with pytest.raises(ValueError, match="profile='huge'"):
        ConvertArgs(profile="huge")


@pytest.mark.parametrize("make, samples", [(EvalArgs, 20), (RecoveryArgs, 4), (TradeoffArgs, 20)])
def test_niah_options_are_one_set_checked_alike(make, samples):
    """eval, recovery and tradeoff take the same --niah_* options (own sample defaults) with the same checks."""
    args = make()
    assert isinstance(args, NiahArgs) and args.niah_samples == samples and args.niah_new_tokens == NIAH_NEW_TOKENS
    for bad in ({"niah_tasks": ["haystack"]}, {"niah_lengths": [32]}, {"niah_samples": 0}, {"niah_new_tokens": 0}):
        with pytest.raises(ValueError, match="niah_"):
            make(**bad)


@pytest.mark.parametrize("module", ["recovery", "tradeoff"])
def test_niah_generation_budget_and_seed_reach_the_scorer(module, monkeypatch, tmp_path):
    """recovery and tradeoff score NIAH with the --niah_new_tokens and --niah_seed they were given."""
    import importlib
    mod = importlib.import_module(f"taylor_calibrate.experiments.{module}")
    seen = {}
    monkeypatch.setattr(mod, "niah_scores", lambda model, tok, **kw: seen.update(kw) or {})
    if module == "recovery":
        mod._niah(torch.nn.Linear(1, 1), None, RecoveryArgs(niah_new_tokens=64, niah_seed=3), torch.device("cpu"), "x")
    else:
        mod._niah(torch.nn.Linear(1, 1), None, TradeoffArgs(niah_new_tokens=64, niah_seed=3, out=str(tmp_path)), "x")
    assert seen["max_new_tokens"] == 64 and seen["seed"] == 3


def test_every_numeric_option_has_a_range_and_values_outside_it_are_refused():
    """--phase2.lr -1, --train.weight_decay -1, --train.temperature 1e-30 ran and reported a model that looked fine.
    Each numeric option of every command (nested groups too) has its interval beside its definition, and the one
    check of the parsed options refuses values outside it, naming the option and the interval."""
    import dataclasses
    import re

    from taylor_calibrate import config

    free = {"seed", "niah_seed", "grad_clip"}  # any finite value means something (grad_clip <= 0: no clipping)

    def numeric(args, prefix=""):
        ranges = config.ranges_of(args)
        for f in dataclasses.fields(args):
            value = getattr(args, f.name)
            if dataclasses.is_dataclass(value):
                yield from numeric(value, f"{prefix}{f.name}.")
            elif re.fullmatch(r"(int|float)( \| None)?", str(f.type)) and f.name not in free:
                yield f"{prefix}{f.name}", ranges.get(f.name)

    commands = (config.ConvertArgs, config.AblateArgs, config.DamageArgs, config.EvalArgs, config.DistillArgs,
                config.RecoveryArgs, config.TradeoffArgs, config.TokenizeArgs)
    missing = {f"{c.__name__} --{n}" for c in commands for n, r in numeric(c()) if r is None}
    assert not missing, missing
    for cls, flag, bad, good in [(config.DistillArgs, "--train.temperature", "1e-30", "0.05"),
                                 (config.DistillArgs, "--train.weight_decay", "-1", "0"),
                                 (config.DistillArgs, "--train.peak_tflops", "-5", "989"),
                                 (config.ConvertArgs, "--phase2.lr_o", "-0.5", "0"),
                                 (config.ConvertArgs, "--phase2.sink_weight", "-1", "0"),
                                 (config.DistillArgs, "--train.warmup", "1", "0.99")]:
        with pytest.raises(ValueError, match=rf"{re.escape(flag)}=\S+ (is out of range: it must lie in|must be)"):
            config.parse_args_of(cls, [flag, bad])
        config.parse_args_of(cls, [flag, good])
    assert config.in_range(0, "[0, 1)") and not config.in_range(1, "[0, 1)") and not config.in_range(0, "(0, inf)")


@pytest.mark.parametrize("command,yaml_text,flag", [
    ("convert", "teacher: null", "--teacher is null"), ("convert", "out: null", "--out is null"),
    ("convert", "policy: null", "--policy is null"), ("convert", "data:\n  source: null", "--data.source is null"),
    ("eval", "model: null", "--model is null"), ("eval", "niah_lengths: null", "--niah_lengths is null"),
    ("distill", "student: null", "--student is null"), ("eval", "niah_tasks: []", "--niah_tasks is empty, so there is nothing to run"),
    ("eval", "niah_lengths: []", "--niah_lengths is empty, so there is nothing to run")])
def test_yaml_nulls_and_empty_lists_are_refused_before_any_work(tmp_path, command, yaml_text, flag):
    """A --config `null` for an option that takes no None ended in a raw TypeError or AttributeError, an empty list in
    StopIteration or ZeroDivisionError after the work began (eval leaving a report.json): refused at parse."""
    from taylor_calibrate.cli import parse

    config = tmp_path / "c.yaml"
    config.write_text(yaml_text + "\n")
    with pytest.raises(ValueError, match=flag):
        parse([command, "--config", str(config)])
    assert list(tmp_path.iterdir()) == [config]
