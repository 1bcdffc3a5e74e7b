"""warpsplitk command line: plan | compile | bench | tune | cache.

Every argument is checked before anything heavy (torch, the CuTe DSL)
loads; a bad one ends the command with exit status 2 and one line on
stderr, "warpsplitk <command>: error: ...", naming the argument, what was
given and what is allowed. The same flag means the same in every command:

--plan    h200: the built-in H200 plan; none: the default (cost model);
          else a plan JSON file (default: the built-in plan of the target
          GPU model where one was measured on it, else none).
--m       Ms in 1..32, e.g. 8, 1,4,8, 1-32 (default: the plan's M
          buckets, 1,4,8,16,24,32); compile --m is one M.
--shapes  N,K pairs and .json shape tables (default: the built-in table).
"""
from __future__ import annotations

import argparse
import os
import sys

from . import bench, cache, compile, plan, tune
from .options import Parser, UsageError

#: The commands in the order ``--help`` lists them; each module adds its parser.
COMMANDS = (plan, compile, bench, tune, cache)

#: The package whose missing modules are bugs, not a dependency left out.
PACKAGE = __name__.partition(".")[0]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="warpsplitk", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    parser.commands = sub.choices
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command they were given to, as argparse's other errors
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)} "
                                                f"(see warpsplitk {args.command} --help)")
    except SystemExit as done:  # --help, or argparse's one-line error
        return done.code if isinstance(done.code, int) else 2
    return _run(args, argv)


def _run(args, argv) -> int:
    """The command's exit status; a user's error as one line, not a traceback."""
    prog = f"warpsplitk {args.command}"
    try:
        return args.func(args, argv)
    except (UsageError, ValueError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `warpsplitk plan | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as error:  # the file system said no: one line, not a traceback
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] == PACKAGE:
            raise  # a module of this package missing is a bug, not the user's set-up
        print(f"{prog}: error: {error}", file=sys.stderr)  # a dependency not installed
        return 1
