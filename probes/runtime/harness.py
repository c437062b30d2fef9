"""Run the differential probes on one SGLang tree and print one JSON document.

Usage (the tree is the only ``sglang`` on the path)::

    PYTHONPATH=<probes/standins/shims>:<PKGROOT> \\
        python PACKAGE/runtime/launch.py harness --tree PKGROOT [--probe NAME ...]

PKGROOT is the directory that contains ``sglang/``. All probes of the tree run
in this one interpreter: importing the SGLang modules costs ~8 s, paid once.

Stdout carries exactly one JSON document; everything else (SGLang's logs,
warnings, stray prints) goes to stderr. Exit code 0 when the harness ran,
whatever the verdicts; 2 on bad input (no ``sglang/`` in the tree, another
``sglang`` shadowing it, an unknown probe name).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import re
import sys
import time
import traceback
from enum import Enum
from typing import Any

from .. import (
    ERROR,
    FALLBACK_VERSIONS,
    NOT_APPLICABLE,
    PROBE_NAMES,
    SAFE,
    TREE_VERSION_ENV,
    UNSAFE,
    Case,
    NotApplicable,
    Outcome,
    ProbeContext,
    cases_of,
)

# Imported once, timed, before any case runs. The probes import them again
# (cached); a tree that fails here reports per-case errors, not a crash.
CORE_MODULES = (
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.disaggregation.common.conn",
    "sglang.srt.managers.scheduler",
)

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def _bad_input(tree: str, message: str, real_stdout) -> int:
    real_stdout.write(json.dumps({"tree": tree, "error": message}) + "\n")
    real_stdout.flush()
    return 2


def jsonable(value: Any) -> Any:
    """Plain JSON values only; anything else by a stable text form."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [jsonable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    return _ADDRESS.sub("0x?", repr(value))


def outside_needs(case: Case, version: str | None) -> str | None:
    """The release range of the case's `needs` that ``version`` is outside (its code is not in such a
    release), or None. Fix ids in `needs` are not judged here (the harness cannot tell which fixes a
    tree has); neither is an unknown version or an interpreter without `packaging`."""
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return None
    try:
        v = Version(version or "")
    except InvalidVersion:
        return None
    for need in case.needs:
        try:
            spec = SpecifierSet(need)
        except InvalidSpecifier:
            continue  # a fix id
        if not spec.contains(v, prereleases=True):
            return need
    return None


def run_case(probe: str, case: Case, version: str | None = None) -> dict[str, Any]:
    ctx = ProbeContext()
    try:
        outcome = case.run(ctx)
        if outcome.verdict not in (SAFE, UNSAFE):
            raise ValueError(f"case returned verdict {outcome.verdict!r}")
    except NotApplicable as exc:
        outcome = Outcome(NOT_APPLICABLE, f"Not applicable: {exc}", {"reason": str(exc)})
    except Exception as exc:  # noqa: BLE001 - every failure is a verdict
        print(f"[probe {probe}/{case.name}] error:", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        message = _ADDRESS.sub("0x?", str(exc))
        need = outside_needs(case, version)
        if need is not None:
            # The missing-code path: the case declares that its code needs releases `need`, this tree's
            # release is outside them, and the case failed on what is not there (never a verdict on it).
            reason = (f"the case's code needs SGLang {need} (this tree is {version}); here it raised "
                      f"{type(exc).__name__}: {message}")
            outcome = Outcome(NOT_APPLICABLE, f"Not applicable: {reason}", {"reason": reason})
        else:
            outcome = Outcome(
                ERROR,
                f"The case raised {type(exc).__name__}: {message}",
                {"exception_type": type(exc).__name__, "message": message},
            )
    finally:
        try:
            ctx.close()
        except Exception:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
    document = {
        "probe": probe,
        "case": case.name,
        "must_preserve": case.must_preserve,
        "expect": case.expect,
        "observed": outcome.observed,
        "verdict": outcome.verdict,
        "details": jsonable(outcome.details),
    }
    if case.beyond_upstream:
        document["beyond_upstream"] = True  # only when set: every other case document stays as it was
    return document


def start_coverage(tree: str, files: list[str]):
    """coverage.py over only the given files of the tree (None when none is asked for)."""
    if not files:
        return None
    import coverage

    from .preload import preload

    preload()  # third-party imports are not what is measured: keep them out of the tracer

    include = [os.path.join(tree, rel) for rel in files]
    cov = coverage.Coverage(data_file=None, include=include, config_file=False, branch=False)
    cov.start()
    return cov


def coverage_report(cov, tree: str, files: list[str]) -> dict[str, Any]:
    """Per file: its executable lines (coverage.py's statements) and those that ran."""
    cov.stop()
    report: dict[str, Any] = {}
    for rel in sorted(set(files)):
        path = os.path.join(tree, rel)
        if not os.path.isfile(path):
            continue  # the release has no such file
        measured, statements, _excluded, missing, _ = cov.analysis2(path)
        # Per case (its dynamic context), the lines it ran; "" (import time, between cases) is left out.
        by_case: dict[str, set[int]] = {}
        for line, contexts in (cov.get_data().contexts_by_lineno(measured) or {}).items():
            for context in contexts:
                if context:
                    by_case.setdefault(context, set()).add(line)
        report[rel] = {"statements": sorted(statements), "executed": sorted(set(statements) - set(missing)),
                       "cases": {name: sorted(lines) for name, lines in sorted(by_case.items())}}
    return report


def tree_own_version(sglang) -> str:
    """The version the imported tree says, when the toolkit passed none (`probe TREE`); "unknown"
    for sglang/version.py's fallback, which says nothing about the release."""
    version = getattr(sglang, "__version__", None)
    if version is None:
        try:
            version = importlib.import_module("sglang.version").__version__
        except Exception:  # noqa: BLE001
            version = "unknown"
    return "unknown" if str(version) in FALLBACK_VERSIONS else str(version)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(message)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="launch.py harness")
    parser.add_argument("--tree", required=True, help="directory that contains sglang/")
    parser.add_argument("--probe", action="append", default=[], help="probe to run (repeatable)")
    parser.add_argument(
        "--version",
        help="the tree's release as the toolkit decided it (git tag, wheel), which "
        "the cases read; default: the tree's own sglang.__version__",
    )
    parser.add_argument("--coverage", action="append", default=[], metavar="FILE",
                        help="record the lines of this file (relative to the tree) that run, from before "
                             "`import sglang` to the last case (repeatable; needs the coverage package)")
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        return _bad_input(None, f"usage: {exc}", sys.stdout)

    # Keep stdout for the one JSON document: SGLang and its dependencies may
    # print, at Python or at C level.
    sys.stdout.flush()
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    tree = os.path.abspath(args.tree)
    unknown = [p for p in args.probe if p not in PROBE_NAMES]
    if unknown:
        return _bad_input(tree, f"unknown probe {unknown[0]!r}; known: {', '.join(PROBE_NAMES)}", real_stdout)
    if not os.path.isfile(os.path.join(tree, "sglang", "__init__.py")):
        return _bad_input(tree, f"{tree} has no sglang/ package", real_stdout)

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from ..standins.addons import install as install_addons
    from ..standins.addons import install_module_standins

    install_addons()  # names older releases read from torch/triton that today's lack (standins/addons.py)
    install_module_standins()  # 0.4.10's 3FS client, whose C++ source its wheel lacks (standins/addons.py)
    coverage_missing = None
    try:
        cov = start_coverage(tree, args.coverage)
    except ImportError:
        # An operator's own interpreter (--python) may lack coverage.py: the run goes on and the
        # document says why no coverage was recorded, rather than claiming any.
        cov, coverage_missing = None, "the probe interpreter has no coverage package"
    started = time.monotonic()
    try:
        import sglang
    except Exception as exc:  # noqa: BLE001
        return _bad_input(tree, f"import sglang failed: {type(exc).__name__}: {exc}", real_stdout)
    sglang_file = os.path.realpath(sglang.__file__ or "")
    if os.path.commonpath([sglang_file, os.path.realpath(tree)]) != os.path.realpath(tree):
        return _bad_input(tree, f"sglang on the path is {sglang_file}, not the tree under test", real_stdout)

    for name in CORE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - reported by the cases
            print(f"[harness] import {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    import_seconds = round(time.monotonic() - started, 3)

    version = args.version or tree_own_version(sglang)
    os.environ[TREE_VERSION_ENV] = version  # what probes.tree_version() answers the cases
    try:
        import torch

        torch_version = torch.__version__
    except Exception:  # noqa: BLE001
        torch_version = None

    cases: list[dict[str, Any]] = []
    for probe in args.probe or list(PROBE_NAMES):
        for case in cases_of(probe):
            if cov is not None:
                cov.switch_context(f"{probe}/{case.name}")
            cases.append(run_case(probe, case, str(version)))
    if cov is not None:
        cov.switch_context("")

    document = {
        "tree": tree,
        "version": str(version),
        "sglang_file": sglang_file,
        "python": platform.python_version(),
        "torch": torch_version,
        "import_seconds": import_seconds,
        "cases": cases,
    }
    if cov is not None:
        document["coverage"] = coverage_report(cov, tree, args.coverage)
    elif coverage_missing:
        document["coverage_unavailable"] = coverage_missing
    real_stdout.write(json.dumps(document, indent=1, sort_keys=False) + "\n")
    real_stdout.flush()
    return 0

