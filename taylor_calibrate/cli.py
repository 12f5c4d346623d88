"""`taylor-calibrate <subcommand>`: each subcommand is one stage function fed by one argument dataclass.

Flags and a YAML file (`--config run.yaml`, a dump of the same dataclass) both fill the arguments;
`taylor-calibrate <subcommand> --print_config` prints the YAML of the current choices.
"""
from __future__ import annotations

import argparse
import difflib
import errno
import functools
import logging
import os
import re
import shlex
import signal
import sys
import threading
import typing
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser, Namespace, set_parsing_settings

from taylor_calibrate.experiments.ablate import run_ablate
from taylor_calibrate.config import (AblateArgs, ConvertArgs, DamageArgs, DistillArgs, EvalArgs, ExportArgs, RecoveryArgs,
                                     TokenizeArgs, TradeoffArgs, args_of, args_parser,
                                     check_values)
from taylor_calibrate.convert import run_convert
from taylor_calibrate.data import run_tokenize
from taylor_calibrate.distill import run_distill
from taylor_calibrate.evaluate import run_eval
from taylor_calibrate.export import run_export
from taylor_calibrate.experiments.damage import run_damage
from taylor_calibrate.experiments.recovery import run_recovery
from taylor_calibrate.experiments.tradeoff import run_tradeoff
from taylor_calibrate.results import ReportArgs, package_state, run_report

COMMANDS = {
    "convert": (ConvertArgs, run_convert),
    "eval": (EvalArgs, run_eval),
    "ablate": (AblateArgs, run_ablate),
    "damage": (DamageArgs, run_damage),
    "tokenize": (TokenizeArgs, run_tokenize),
    "distill": (DistillArgs, run_distill),
    "recovery": (RecoveryArgs, run_recovery),
    "tradeoff": (TradeoffArgs, run_tradeoff),
    "export": (ExportArgs, run_export),
    "report": (ReportArgs, run_report),
}


@functools.cache  # building it reads every option's docstring: once per process
def build_parser() -> ArgumentParser:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings become --help
    parser = ArgumentParser(prog="taylor-calibrate", description=__doc__.splitlines()[0], exit_on_error=False)
    sub = parser.add_subcommands(dest="command")
    for name, (args_cls, fn) in COMMANDS.items():
        sub.add_subcommand(name, args_parser(args_cls, fn.__doc__), help=fn.__doc__)
    return parser


def parse(argv: list[str] | None = None):
    """argv -> (subcommand name, its argument dataclass)."""
    words = sys.argv[1:] if argv is None else argv
    if command := next((w for w in words if w in COMMANDS), None):
        check_config_groups(words, COMMANDS[command][0])
    parser = build_parser()
    cfg = parser.parse_args(argv)
    name = cfg.command
    check_groups(cfg[name], _subparser(name).get_defaults())
    check_values(cfg[name], COMMANDS[name][0])
    return name, args_of(COMMANDS[name][0], parser.instantiate(cfg)[name])


def _subparser(name: str | None) -> ArgumentParser:
    parser = build_parser()
    return parser._subcommands_action._name_parser_map[name] if name else parser


def check_groups(values: Namespace, defaults: Namespace, prefix: str = "") -> None:
    """A group of options (--phase2, --data, ...) set to a scalar or list by a YAML --config passes the parser and
    fails in building the arguments with a TypeError page: refuse it naming the group and its form."""
    for key, default in vars(defaults).items():
        value = getattr(values, key, None)
        if isinstance(default, Namespace):
            if not isinstance(value, Namespace):
                raise ValueError(not_a_group(prefix + key, value))
            check_groups(value, default, f"{prefix}{key}.")


def check_config_groups(words: list[str], args_cls) -> None:
    """A --config file that gives a list for an option group (`data: [corpus, 32]`) passes the parser, which drops it
    in silence (the run then reads the default corpus): refused naming the group, as a scalar there is."""
    from dataclasses import MISSING, fields, is_dataclass

    groups = {f.name for f in fields(args_cls)
              if is_dataclass(f.default_factory() if f.default_factory is not MISSING else f.default)}
    for value in config_files(words):
        try:
            cfg = yaml.safe_load(Path(value).read_text() if os.path.isfile(value) else value)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # the parser, or check_config_files, words it
        for key, v in (cfg.items() if isinstance(cfg, dict) else []):
            if key in groups and v is not None and not isinstance(v, dict):
                raise ValueError(not_a_group(str(key), v))


def not_a_group(key: str, value) -> str:
    return (f"--{key} {value!r} is not a set of options: set them one by one (--{key}.NAME VALUE) or as a mapping "
            f"('{{NAME: VALUE}}', or `{key}:` over indented lines in a --config file)")


def config_files(words: list[str]) -> list[str]:
    """The values given to --config in a command line."""
    return [w.split("=", 1)[1] if w.startswith("--config=") else words[i + 1] for i, w in enumerate(words)
            if w.startswith("--config=") or (w == "--config" and i + 1 < len(words))]


def check_config_files(words: list[str]) -> None:
    """A --config that names a pipe or device would block the parser for ever, and one that is not text fails in it
    without naming the file: refuse both (a YAML string is fine)."""
    for value in config_files(words):
        if os.path.exists(value) and not os.path.isfile(value):
            raise ValueError(f"--config {value} is not a regular file (a directory, pipe or device); pass a YAML file")
        if os.path.isfile(value):
            try:
                with open(value, encoding="utf-8") as f:
                    f.read()
            except UnicodeDecodeError as e:  # the parser's own message names neither the file nor the option
                raise ValueError(f"--config {value} is not UTF-8 text ({e.reason} at byte {e.start}); pass a YAML "
                                 "file") from None


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def describe(e: BaseException, args=None) -> str:
    """The error line: the message on one line (a library's message quoted in ours may span several), with a bare
    OSError of the system (a full disk, no permission) given the file or output it concerns and the fix."""
    if not isinstance(e, OSError) or not str(e).startswith("[Errno") or \
            e.errno not in _FULL + _DENIED + (errno.ENAMETOOLONG,):
        return " ".join(str(e).split())
    where = e.filename or getattr(args, "out", None)
    if e.errno == errno.ENAMETOOLONG:
        return f"a path is longer than the file system allows{f' ({where})' if where else ''}; pass a shorter one"
    if e.errno in _FULL:
        return (f"no space left on the device{f' writing {where}' if where else ''} ({e.strerror}); free space there "
                "or pass another --out")
    return f"{e.strerror}{f': {where}' if where else ''}; fix the permissions there or pass another path"


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's time limit, `docker stop`) or SIGHUP (the terminal or ssh session closed) taken
    as a Ctrl-C: the same cleanup of staged outputs and locks, and the same one line, where the default action would
    end the process on the spot, silently."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


def _terminated(signum, frame):
    raise Terminated(signum)


_FORMS = {"list": "a list, written '[a, b]'", "int": "an integer", "float": "a number", "bool": "true or false",
          "str": "a string"}
_TYPE = r"(?:<class '(\w+)'>|(list)\[[^\]]*\])"
_WRONG_FORM = re.compile(r'Parser key "([^"]+)": (?:Expected a <class \'(\w+)\'>\. Got value|Does not validate '
                         rf'against any of the Union subtypes Subtypes: \[{_TYPE}, <class \'NoneType\'>\].*Given '
                         r'value):? ?(.*)')


def _guess(option: str, name: str | None) -> str:
    """' (did you mean --x?)' for the closest option of command `name`, or ''."""
    known = [o for o in _subparser(name)._option_string_actions if o.startswith("--")]
    close = difflib.get_close_matches(option if option.startswith("--") else f"--{option}", known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _of_strings(option: str, name: str | None) -> bool:
    """Whether an option of command `name` takes a list of strings (its items are quoted in the list's form)."""
    action = _subparser(name)._option_string_actions.get(f"--{option}")
    return typing.get_args(getattr(action, "_typehint", None)) == (str,)  # jsonargparse's record of the type


def usage_error(e: argparse.ArgumentError, name: str | None, words: list[str] = ()) -> str:
    """jsonargparse's message (a usage page, then "Parser key ...:" over two lines) as one line naming the option and
    the form it takes, else --help."""
    text = " ".join(str(e).split())
    help_ = f"see `taylor-calibrate {name + ' ' if name else ''}--help`"
    config = " ".join(config_files(list(words)))
    where = f"in --config {config}" if config else "in a group's mapping"
    if m := re.fullmatch(r'Parser key "([^"]+)": Unable to load config (\'.*?\'|".*?") - (.*)', text):
        if m[3].startswith(f'Parser key "{m[1]}": Unable to load config'):
            return f"{not_a_group(m[1], m[2][1:-1])} ({help_})"
        if m[3].startswith("Parser key"):  # a value inside the group's mapping
            return usage_error(argparse.ArgumentError(None, m[3]), name, words)
        return f"--{m[1]} {m[2]} is not valid YAML ({m[3]}); write a mapping '{{NAME: VALUE}}' ({help_})"
    if m := _WRONG_FORM.fullmatch(text):
        kind = m[2] or m[3] or m[4]
        if kind in _FORMS:
            words = list(words)
            given = next((b if a == f"--{m[1]}" else a.split("=", 1)[1] for a, b in zip(words, words[1:] + [""])
                          if a == f"--{m[1]}" or a.startswith(f"--{m[1]}=")), "")
            quote = (" (in a list, an item holding a comma or a colon goes in double quotes: '[\"5,17\", "
                     "\"5:512\"]')") if kind == "str" and given.lstrip().startswith("[") else ""
            form = "a list, written '[\"a\", \"b\"]'" if kind == "list" and _of_strings(m[1], name) else _FORMS[kind]
            return f"--{m[1]} {m[5]!r} is not {form}{quote} ({help_})"
    forms = {
        r'expected "command" to be one of .*but it was not provided\.?': lambda m: "no command given; pass one of "
        f"{', '.join(COMMANDS)} ({help_})",
        r"argument command: invalid choice: '(.*?)' .*": lambda m: f"{m[1]!r} is not a command; pass one of "
        f"{', '.join(COMMANDS)} ({help_})",
        r"unrecognized arguments: (--[^\s=]+).*": lambda m: f"{m[1]} is not an option of `{name}`{_guess(m[1], name)} "
        f"({help_})",
        r"unrecognized arguments: (.*)": lambda m: f"{m[1]!r} follows no option: each option takes one value (a list "
        f"is written '[a, b]', in quotes on a shell) ({help_})",
        r"argument (--\S+): expected one argument": lambda m: f"{m[1]} needs a value ({m[1]} VALUE) ({help_})",
        r"(?:Subcommand '\w+' does not accept option|Option) '([^']+)'(?: is not accepted)?": lambda m: f"{m[1]!r} "
        f"({where}) is not an option of `{name}`{_guess(m[1], name)} ({help_})",
        r'Parser key "config": File does not exist: \'?(.*?)\'?': lambda m: f"--config {m[1]} does not exist; pass a "
        "YAML file of `option: value` lines",
        r"Unexpected config:(.*)": lambda m: f"--config {config} holds no `option: value` mapping ("
        f"{'it is empty' if not m[1] else 'it holds' + m[1][:60]}); write one option a line, e.g. `seed: 0`",
        r"Problems parsing config: (.*)": lambda m: f"--config {config} is not valid YAML ({m[1]}); fix the file",
        r'Invalid option "(.*)" for --print_config': lambda m: f"--print_config={m[1]} is not one of its flags: pass "
        "--print_config alone, or =skip_default or =skip_unset",
    }
    for pattern, say in forms.items():
        if m := re.fullmatch(pattern, text):
            return say(m)
    return f"{text}; {help_}"


def prog(name: str | None) -> str:
    """What the error line starts with: the program, and the command when one was given."""
    return f"taylor-calibrate {name}" if name else "taylor-calibrate"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    words = sys.argv[1:] if argv is None else argv
    name = next((w for w in words if w in COMMANDS), None)  # for the error line, before parsing succeeds
    args = None
    main_thread = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    old_hangup = signal.signal(signal.SIGHUP, _terminated) if main_thread else None
    old_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler) if main_thread else None  # was startup's
    try:
        check_config_files(words)
        name, args = parse(argv)
        package_state()  # the code this run starts from, recorded in its results however long it runs
        if getattr(args, "command", "") is None:  # results record the command line that made them
            args.command = "taylor-calibrate " + shlex.join(sys.argv[1:] if argv is None else argv)
        COMMANDS[name][1](args)
    except argparse.ArgumentError as e:
        print(f"{prog(name)}: error: {usage_error(e, name, words)}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, OSError, RuntimeError, ImportError) as e:
        print(f"{prog(name)}: error: {describe(e, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        how = f" ({signal.Signals(e.signum).name})" if isinstance(e, Terminated) else ""
        print(f"{prog(name)}: interrupted{how}; nothing half-written was kept (outputs appear whole "
              "or not at all; distill resumes from its last checkpoint)", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Terminated) else 130
    finally:  # a caller of main() in-process (the tests) keeps its own handler
        if main_thread:
            signal.signal(signal.SIGTERM, old_handler)
            signal.signal(signal.SIGHUP, old_hangup)
            signal.signal(signal.SIGINT, old_interrupt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
