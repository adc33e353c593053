"""The carpool command line: one command (verb) a module of carpool/commands, each owning its flags.

This file only dispatches.  Each verb's module (``carpool.commands.<verb>``) exposes
``add_arguments(parser)`` and ``main(args) -> int`` and owns its flags and its printing;
it is imported only when its verb runs, so ``carpool run`` never pays for importing the
server or Ray.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from carpool.commands.flags import CommandParser, unknown_flags
from carpool.engine.process import configure_process

DESCRIPTION = "Run large batches of LLM work at the highest throughput this machine allows."

VERBS: dict[str, tuple[str, str]] = {
    "run": ("carpool.commands.run", "run every task of a file (JSONL/Batch/CSV/Parquet)"),
    "serve": ("carpool.commands.serve", "OpenAI-compatible server over the engine"),
    "bench": ("carpool.commands.bench", "load-test an endpoint or the embedded engine"),
    "diagnose": ("carpool.commands.diagnose", "explain where the time goes"),
    "simulate": ("carpool.commands.simulate", "discrete-event simulation of a serving engine"),
    "tune": ("carpool.commands.tune", "find the settings with the best goodput under an SLO"),
    "cache": ("carpool.commands.cache", "inspect or clear the result cache"),
    "engine": ("carpool.commands.engine", "prepare the engine for this machine (kernels, plan) or show its plan"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and each verb's own (whose usage a bad flag of that verb prints)."""
    from carpool import __version__

    parser = CommandParser(prog="carpool", description=DESCRIPTION,
                           epilog="'carpool COMMAND --help' shows what a command does and its flags.")
    parser.add_argument("--version", action="version", version=f"carpool {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND", title="commands")
    sub.required = True
    wanted = next((a for a in argv if not a.startswith("-")), None)
    if wanted is not None and wanted not in VERBS:
        near = difflib.get_close_matches(wanted, list(VERBS), n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(near)}?" if near else f"; the commands are {', '.join(VERBS)}"
        parser.error(f"unknown command {wanted!r}{hint}")
    verbs = {}
    for verb, (module, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        verbs[verb] = p
        # Only the verb being run imports its module; the others show their one-line help.
        if verb == wanted:
            importlib.import_module(module).add_arguments(p)
    return parser, verbs


def parse(argv: list[str]) -> argparse.Namespace:
    """The arguments; a flag the verb does not know is that verb's error (one line naming the
    closest flags it has, exit 2), not the top-level parser's."""
    parser, verbs = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        verbs[args.verb].error(unknown_flags(verbs[args.verb], unknown))
    return args


def main(argv: list[str] | None = None) -> int:
    from carpool.errors import MissingExtra

    argv = sys.argv[1:] if argv is None else argv
    # Before any verb imports torch: the OpenMP wait policy is read when torch loads.
    configure_process()
    args = parse(argv)
    module = importlib.import_module(VERBS[args.verb][0])
    try:
        return int(module.main(args) or 0)
    except MissingExtra as e:  # a feature of an extra that is not installed: say which, exit 2
        print(f"carpool {args.verb}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
