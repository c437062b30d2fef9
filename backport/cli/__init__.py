"""`sglang-backport`: a thin CLI over the toolkit's library (sources, engine, probing, job, evidence).

Exit codes: 0 success or safe, 1 a finding, 2 bad input (one line, no traceback).
With --json every subcommand prints exactly one JSON document on stdout, also on an error
(`{"error": {"code": N, "message": ...}}`); progress and human output go to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
from typing import NoReturn

from backport import __version__
from backport.errors import BadInput, Finding, Interrupted
from backport.signals import handling

# Each module adds its subcommands with `register(subparsers)`.
COMMAND_MODULES = (
    "backport.cli.trees",
    "backport.cli.probe",
    "backport.cli.live",
    "backport.cli.run",
    "backport.cli.verify",
    "backport.cli.upstream",
    "backport.cli.export",
    "backport.cli.refresh",
    "backport.audit.command",
    "backport.cli.fanout",
)
DEBUG_ENV = "SGLANG_BACKPORT_DEBUG"


class UsageError(Exception):
    """An argparse error, turned into one line and exit 2 by `main`."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sglang-backport", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sglang-backport {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _error(wants_json: bool, code: int, message: str) -> int:
    message = " ".join(message.split()) if code == 2 else message
    if wants_json:
        print(json.dumps({"error": {"code": code, "message": message}}, sort_keys=True))
    prefix = "sglang-backport: error: " if code == 2 else "sglang-backport: "
    print(prefix + message, file=sys.stderr)
    return code


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("backport")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _signals_raise():
    """SIGTERM and SIGHUP raise Interrupted while a command runs, so its cleanup runs (Python's
    default for them ends the process without any `finally`); the old handlers come back after."""

    def handler(signum, _frame):
        raise Interrupted(signum)

    return handling(STOP_SIGNALS, handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _configure_logging()
    try:
        with _signals_raise():
            code = _dispatch(argv, "--json" in argv)
        sys.stdout.flush()  # inside the try: a closed pipe is reported here, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as a shell pipeline expects.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _dispatch(argv: list[str], wants_json: bool) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as exc:
        return _error(wants_json, 2, str(exc))
    except BadInput as exc:
        return _error(wants_json, 2, str(exc))
    except Finding as exc:
        document = getattr(exc, "document", None)
        if wants_json and document is not None:
            print(json.dumps(document, indent=2, sort_keys=True))
            print(f"sglang-backport: {exc}", file=sys.stderr)
            return 1
        return _error(wants_json, 1, str(exc))
    except (KeyboardInterrupt, Interrupted) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        print(
            f"sglang-backport: interrupted by {signal.Signals(signum).name}: stopped; every process it "
            "started "
            f"is ended and its temporary files removed",
            file=sys.stderr,
        )
        return 128 + signum
    except BrokenPipeError:
        raise
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        return _error(wants_json, 1, f"internal error: {type(exc).__name__}: {exc} "
                                     f"(set {DEBUG_ENV}=1 for the traceback)")


def emit(args, document: dict, human: str) -> None:
    """One JSON document with --json, else the human text, on stdout."""
    if getattr(args, "json", False):
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        print(human)


if __name__ == "__main__":
    sys.exit(main())
