"""The flags several verbs share, defined once so that a flag means the same in every verb.

- value types: ``duration`` (``90``, ``30s``, ``15m``, ``2h``, ``1d``), positive numbers,
  an endpoint base URL checked for its shape;
- ``add_target_flags``: ``--endpoint`` / ``--model`` / ``--api-key`` as vLLM and OpenAI name
  them (``--model`` is always the model: the name sent to an endpoint, or the one the
  embedded engine loads);
- ``add_json_flag``: ``--json [PATH|-]``, the one spelling of "the result as JSON";
- ``api_key``: ``--api-key``, else ``$CARPOOL_API_KEY``, else ``$OPENAI_API_KEY``;
- ``DeprecatedAlias``: an old spelling that still works and says what to write instead;
- ``CommandParser``: a command's parser whose errors are one short line, not its usage, and
  ``unknown_flags``: what to say of flags a command does not take (the closest ones it does).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from carpool.durations import parse_duration

DATA_SUFFIXES = (".jsonl", ".ndjson", ".csv", ".tsv", ".parquet", ".pq")


def duration(value: str) -> float:
    """A positive length of time, in seconds."""
    try:
        seconds = parse_duration(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a duration must be more than 0")
    return seconds


def duration_or_zero(value: str) -> float:
    """A length of time where 0 means "not at all"."""
    try:
        return parse_duration(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _number(kind: Callable[[str], Any], low: float, strict: bool, what: str) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}") from None
        if number != number or (number <= low if strict else number < low):  # nan, or out of range
            raise argparse.ArgumentTypeError(f"{value!r}: must be {what}")
        return number

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, 0, True, "a positive integer")
non_negative_int = _number(int, 0, False, "an integer >= 0")
positive_float = _number(float, 0.0, True, "a number > 0")
non_negative_float = _number(float, 0.0, False, "a number >= 0")


def endpoint_url(value: str) -> str:
    """An endpoint base URL of a usable shape (``http://host:port/v1``), refused at parse otherwise."""
    from carpool.jobs.preflight import endpoint_url_problem

    problem = endpoint_url_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value.strip()


def api_key(given: str | None) -> str | None:
    """``--api-key``, else ``$CARPOOL_API_KEY``, else ``$OPENAI_API_KEY`` (the same in every verb)."""
    return given or os.environ.get("CARPOOL_API_KEY") or os.environ.get("OPENAI_API_KEY")


class DeprecatedAlias(argparse.Action):
    """Stores like the flag it stands for, and tells the user the new spelling once."""

    def __init__(self, option_strings, dest, new: str, then: type[argparse.Action] | None = None, **kw):
        self.new = new
        self.inner = (then or argparse._StoreAction)(option_strings, dest, **kw)
        super().__init__(option_strings, dest, nargs=self.inner.nargs, const=self.inner.const,
                         # typeshed lets Action.type hold a registry name but not __init__ take one
                         default=self.inner.default, type=self.inner.type,  # type: ignore[arg-type]
                         choices=self.inner.choices,
                         help=argparse.SUPPRESS, metavar=self.inner.metavar)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"carpool: {option_string} is deprecated; write {self.new}", file=sys.stderr)
        self.inner(parser, namespace, values, option_string)


def add_target_flags(g: argparse._ActionsContainer, *, many: bool = False, engine: bool = True) -> None:
    """``--endpoint``, ``--model``, ``--api-key``; ``many``: ``--endpoint`` may repeat."""
    where = ("(repeat for several); " if many else "") + \
        ("default: the embedded engine in-process" if engine else "")
    if many:
        g.add_argument("--endpoint", action="append", default=[], type=endpoint_url,
                       help=f"OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 {where}")
    else:
        g.add_argument("--endpoint", type=endpoint_url,
                       help=f"OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 {where}")
    g.add_argument("--model", help="the model: the name sent to --endpoint (vLLM's served model name), or the "
                                   "one the embedded engine loads (smollm2, also called HuggingFaceTB/SmolLM2-135M-"
                                   "Instruct; tiny-random; a HF folder or a name in the local HF cache)")
    g.add_argument("--api-key", default=None, help="bearer token for the endpoint (default: $CARPOOL_API_KEY, "
                                                   "else $OPENAI_API_KEY)")


def _json_target(value: str) -> str:
    # An existing tasks or data file is never where JSON should go (``--json tasks.jsonl``, the
    # input taken for the flag's value); a ``.json`` file may be last run's summary.
    if value != "-" and value.endswith(DATA_SUFFIXES) and os.path.exists(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is an input file, not where the JSON goes: write --json=- (stdout) or --json PATH, "
            "or put --json after the input")
    return value


def add_json_flag(g: argparse._ActionsContainer, what: str, *aliases: str, dest: str = "json_out") -> None:
    """``--json [PATH|-]``: ``what`` as JSON to PATH, or to stdout with ``-`` or no value.
    ``aliases``: older spellings of the same flag, kept working."""
    g.add_argument("--json", *aliases, nargs="?", const="-", default=None, type=_json_target, metavar="PATH|-",
                   dest=dest, help=f"write {what} as JSON to PATH ('-' or no value: stdout)"
                   + (f"; also spelt {', '.join(aliases)}" if aliases else ""))


def write_json(text: str, target: str) -> None:
    """JSON text to ``target`` ('-': stdout)."""
    if target == "-":
        print(text)
    else:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text + "\n")


class CommandParser(argparse.ArgumentParser):
    """An error is one line and a pointer to ``--help``: a command with many flags printed
    a screenful of usage above the one line that said what was wrong."""

    def error(self, message: str) -> NoReturn:
        what = "its flags" if " " in self.prog else "the commands"  # a command's parser, or carpool's
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists {what})\n")


def _spellings(parser: argparse.ArgumentParser) -> list[str]:
    """The long flags a user is shown (old spellings stay out of suggestions)."""
    return [o for a in parser._actions if a.help != argparse.SUPPRESS
            for o in a.option_strings if o.startswith("--")]


def closest_flags(parser: argparse.ArgumentParser, flag: str) -> list[str]:
    """The flags ``flag`` was probably meant to be: the same with dashes for underscores
    (vLLM's and the OpenAI body's spelling, ``--max_tokens``), else the nearest by letters."""
    known = _spellings(parser)
    dashed = "--" + flag.lstrip("-").replace("_", "-")
    if dashed in known:
        return [dashed]
    return difflib.get_close_matches(dashed, known, n=2, cutoff=0.7)


def unknown_flags(parser: argparse.ArgumentParser, extra: Sequence[str]) -> str:
    """What to say of arguments ``parser`` did not take: each unknown flag with the closest
    ones it has; a value right after an unknown flag is taken to be that flag's."""
    said: list[str] = []
    after_flag = False
    for token in extra:
        if token.startswith("-") and len(token) > 1:
            flag = token.split("=", 1)[0]
            near = closest_flags(parser, flag)
            said.append(f"unknown flag {flag}" + (f" (did you mean {' or '.join(near)}?)" if near else ""))
            after_flag = "=" not in token
        elif not after_flag:
            said.append(f"unexpected argument {token!r}")
        else:
            after_flag = False
    return "; ".join(said)
