"""`taylor-calibrate <subcommand>`: each subcommand is one stage function fed by one argument dataclass.

Flags and a YAML file (`--config run.yaml`, a dump of the same dataclass) both fill the arguments;
`taylor-calibrate <subcommand> --print_config` prints the YAML of the current choices.
"""
from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import re
import shlex
import signal
import sys
import threading

from jsonargparse import ArgumentParser, set_parsing_settings

from taylor_calibrate.experiments.ablate import run_ablate
from taylor_calibrate.config import (AblateArgs, ConvertArgs, DamageArgs, DistillArgs, EvalArgs, ExportArgs, RecoveryArgs,
                                     TokenizeArgs, TradeoffArgs, args_of, args_parser)
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
    parser = build_parser()
    cfg = parser.parse_args(argv)
    name = cfg.command
    return name, args_of(COMMANDS[name][0], parser.instantiate(cfg)[name])


def check_config_files(words: list[str]) -> None:
    """A --config that names a pipe or device would block the parser for ever, and one that is not text fails in it
    without naming the file: refuse both (a YAML string is fine)."""
    for i, w in enumerate(words):
        if w.startswith("--config="):
            value = w.split("=", 1)[1]
        elif w == "--config" and i + 1 < len(words):
            value = words[i + 1]
        else:
            continue
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
    """The error line: the message, with a bare OSError of the system (a full disk, no permission) given the file or
    output it concerns and the fix."""
    if not isinstance(e, OSError) or not str(e).startswith("[Errno") or e.errno not in _FULL + _DENIED:
        return str(e)
    where = e.filename or getattr(args, "out", None)
    if e.errno in _FULL:
        return (f"no space left on the device{f' writing {where}' if where else ''} ({e.strerror}); free space there "
                "or pass another --out")
    return f"{e.strerror}{f': {where}' if where else ''}; fix the permissions there or pass another path"


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's time limit, `docker stop`) taken as a Ctrl-C: the same cleanup of staged outputs
    and locks, and the same one line, where the default action would end the process on the spot."""


def _terminated(signum, frame):
    raise Terminated


_FORMS = {"list": "a list, written '[a, b]'", "int": "an integer", "float": "a number", "bool": "true or false",
          "str": "a string"}


def usage_error(e: argparse.ArgumentError, name: str | None) -> str:
    """jsonargparse's message (a usage page, then "Parser key ...:" over two lines) as one line with the fix: the form
    the option takes, else --help."""
    text = " ".join(str(e).split())
    help_ = f"see `taylor-calibrate {name + ' ' if name else ''}--help`"
    m = re.fullmatch(r'Parser key "([^"]+)": (?:Expected a <class \'(\w+)\'>\. Got value|Does not validate against '
                     r'any of the Union subtypes Subtypes: \[<class \'(\w+)\'>, <class \'NoneType\'>\].*Given value): '
                     r'(.*)', text)
    kind = m and (m[2] or m[3])
    if kind in _FORMS:
        return f"--{m[1]} {m[4]!r} is not {_FORMS[kind]} ({help_})"
    return f"{text}; {help_}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    words = sys.argv[1:] if argv is None else argv
    name = next((w for w in words if w in COMMANDS), None)  # for the error line, before parsing succeeds
    args = None
    main_thread = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        check_config_files(words)
        name, args = parse(argv)
        package_state()  # the code this run starts from, recorded in its results however long it runs
        if getattr(args, "command", "") is None:  # results record the command line that made them
            args.command = "taylor-calibrate " + shlex.join(sys.argv[1:] if argv is None else argv)
        COMMANDS[name][1](args)
    except argparse.ArgumentError as e:
        print(f"taylor-calibrate {name or ''}: error: {usage_error(e, name)}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, OSError, RuntimeError, ImportError) as e:
        print(f"taylor-calibrate {name or ''}: error: {describe(e, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        how = " (SIGTERM)" if isinstance(e, Terminated) else ""
        print(f"taylor-calibrate {name or ''}: interrupted{how}; nothing half-written was kept (outputs appear whole "
              "or not at all; distill resumes from its last checkpoint)", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    finally:  # a caller of main() in-process (the tests) keeps its own handler
        if main_thread:
            signal.signal(signal.SIGTERM, old_handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
