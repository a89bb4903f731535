"""The manners both tools' parsers share: no abbreviated flags, an unknown flag reported
by the subcommand it was given to, "did you mean" for a mistyped subcommand or flag, and
``--version``. The standard library and the version constant only, so ``--version`` and
a usage error start at once (tests/bench/bench_startup.py).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

from actors.runtime.durations import DurationError, parse_duration
from schemas.version import AGENT_VERSION


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors add the closest subcommand or flag:
    ``invalid choice: 'nodse' ...; did you mean 'nodes'?``."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{self.suggestion(message)}\n")

    def suggestion(self, message: str) -> str:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            choices = re.findall(r"'([^']*)'", choice.group(2))
            return closest_hint(choice.group(1), choices)
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [word for word in unknown.group(1).split() if word.startswith("--")]
            if flags:
                return closest_hint(flags[0].split("=")[0], option_strings(self))
        return ""


def closest_hint(word: str, choices: list[str]) -> str:
    """``; did you mean 'json'?`` for the choice closest to ``word`` (difflib), else ""."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of ``parser`` and of the subcommands under it."""
    found: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(option_strings(sub))
        elif action.help != argparse.SUPPRESS:
            found.extend(action.option_strings)
    return found


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {AGENT_VERSION}",
        help="print the version and exit",
    )


def strict(root: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``root`` and every subcommand parser under it with abbreviations turned off, so
    ``--dead`` is an error rather than a silent ``--deadline`` (and a flag added later
    cannot change what an old abbreviation meant), each knowing itself for :func:`parse`.
    Walks the tree, so no parser is missed."""
    root.allow_abbrev = False
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                # The deepest subcommand parsed sets it last: its usage is shown by parse().
                sub.set_defaults(usage_parser=sub)
                strict(sub)
    return root


def parse(root: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``root.parse_args(argv)``, but an unknown flag is reported by the subcommand it was
    given to, with that subcommand's usage (argparse leaves it to the root, whose usage
    lists every subcommand and none of its flags)."""
    args, unknown = root.parse_known_args(argv)
    if unknown:
        used: argparse.ArgumentParser = getattr(args, "usage_parser", root)
        used.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def duration(text: str) -> float:
    """An argparse type: a positive duration, ``30``, ``30s``, ``500ms``, ``10m``, ``1h``,
    ``2d``, read by the runtime's one duration parser."""
    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be positive")
    return seconds


def fail(message: str, code: int = 1) -> int:
    """``message`` as the one line ``error: ...`` on stderr; ``code`` to exit with."""
    sys.stderr.write(f"error: {message}\n")
    return code
