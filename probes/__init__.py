"""Differential probes of sglang-backport.

CPU scenarios that import the real SGLang modules of ONE tree (the only
``sglang`` on ``sys.path``) and drive them through the steps of the 2026 PD
cross-request KV exposure. Each probe lists cases (registered with ``@case``); each case
states the safe behaviour and reports what it observed. The package is sorted by kind
(docs/decisions.md, "probes/ by kind"):

- ``cases/``: the probes, what a reviewer checks against an upstream PR. A probe is a module of
  ``probes.cases`` or, where its scenarios outgrow one module, a package whose ``__init__`` imports
  its scenario modules in order (``probes/cases/prefill_drain/``): every case is named
  ``probe/case`` either way. No case module imports another (tests/test_probe_layout.py).
- ``rigs/``: scaffolding that builds the tree's own objects for a scenario and drives them
  (a prefill door, a transfer manager, a handoff); shared by cases, registers no case.
- ``standins/``: what stands for a GPU, RDMA, a model or a missing package (ledgers, recording
  senders, stand-in engines, ``shims/`` put on the path, ``addons``).
- ``runtime/``: the child process itself (the harness, the matrix runner, its code caches).

This package runs inside the probe virtualenv, never in the toolkit's: it uses
only the standard library, torch and the tree under test. It never imports
``backport``, and imports itself relatively, so it runs under any name from any folder. Entry point:
``python probes/runtime/launch.py harness --tree PKGROOT``.

The shared case machinery lives here (not in ``harness``): the package's root is what every case
imports, and the one place the registry lives.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROBE_NAMES = ("admission", "prefill_retire", "tree_release", "handoff", "page_lifetime", "prefill_drain",
               "transfer_coverage", "flush_holds", "flush_queued", "mori_hold", "refused_room",
               "bootstrap_routes",
               "admin_routes")

SAFE = "safe"
UNSAFE = "unsafe"
ERROR = "error"
NOT_APPLICABLE = "not-applicable"

_MISSING = object()


class NotApplicable(Exception):
    """Raised by a case whose target code does not exist in the tree."""


TREE_VERSION_ENV = "SGLANG_BACKPORT_TREE_VERSION"  # set by the harness for the cases of one tree
FALLBACK_VERSIONS = ("0.0.0.dev0", "0.0.0")  # sglang/version.py's answer without a generated _version.py


def tree_version():
    """The release of the tree under test as the toolkit decided it (the harness's ``--version``), a
    ``packaging`` Version. A case deciding applicability by release reads this, never
    ``sglang.version``, whose fallback (0.0.0.dev0 on an upstream checkout) would make every range
    check say "before"; an unknown version raises (the case errors, it is never not-applicable)."""
    from packaging.version import Version

    said = os.environ.get(TREE_VERSION_ENV, "unknown")
    if said in ("unknown", "", *FALLBACK_VERSIONS):
        raise RuntimeError(f"the tree's version is unknown ({said!r}): the harness was given no --version")
    return Version(said)


@dataclass
class Outcome:
    verdict: str
    observed: str
    details: dict[str, Any] = field(default_factory=dict)


def judged(problems: list[str], safe: str, details: dict[str, Any], *, unsafe_prefix: str = "") -> Outcome:
    """A case's verdict from the problems it found: safe (observed: `safe`) when there are none,
    else unsafe, observing each problem (after `unsafe_prefix`)."""
    if not problems:
        return Outcome(SAFE, safe, details)
    return Outcome(UNSAFE, unsafe_prefix + "; ".join(problems) + ".", details)


@dataclass(frozen=True)
class Case:
    probe: str
    name: str
    must_preserve: bool
    expect: str
    run: Callable[[ProbeContext], Outcome]
    # a case of this pack's own fix, which no release (the reference included) has: the patched
    # tree is not expected to agree with the reference on it
    beyond_upstream: bool = False
    # What the release matrix derives this case's expected verdict from (backport/expectations.py):
    # `proves`, the fixes (ids of patches/fixes.toml) that must all be in a tree for the case to be
    # safe there ("a|b": either of two fixes that close the same path on different releases);
    # `needs`, what the case's code needs to exist, each a PEP 440 range of releases (">=0.5.13")
    # or a fix id whose code the case drives (present once shipped or applied).
    # Without the code: not-applicable; without a proven fix: unsafe; else safe.
    proves: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()


# probe name -> its cases in definition order; filled by @case as each probe module is imported.
REGISTRY: dict[str, list[Case]] = {}


def case(*, must_preserve: bool, expect: str, beyond_upstream: bool = False, proves: tuple[str, ...] = (),
         needs: tuple[str, ...] = ()) -> Callable[[Callable[..., Outcome]], Callable[..., Outcome]]:
    """Register the decorated function as a case of the probe whose module defines it (for a probe
    that is a package, the package: ``probes.cases.prefill_drain.drain_ack`` registers into
    ``prefill_drain``).

    The case's name is the function's name; `expect` states the safe behaviour; a
    must-preserve case is one that a fix must not break (safe on every tree) and proves no fix.
    `proves` and `needs` (see `Case`) are plain strings, checked against the pack by the toolkit.
    """
    for what, value in (("proves", proves), ("needs", needs)):
        if not isinstance(value, tuple) or not all(isinstance(v, str) and v.strip() for v in value):
            raise ValueError(f"{what} must be a tuple of non-empty strings, not {value!r}")
    if must_preserve and proves:
        raise ValueError("a must-preserve case proves no fix: it is safe on every tree that has its code")

    def register(run: Callable[..., Outcome]) -> Callable[..., Outcome]:
        # rigs, stand-ins and the runtime register no case
        if not run.__module__.startswith(f"{__name__}.cases."):
            raise ValueError(f"{run.__module__}.{run.__name__}: a case lives under {__name__}.cases")
        probe = run.__module__.removeprefix(f"{__name__}.cases.").split(".")[0]
        cases = REGISTRY.setdefault(probe, [])
        if any(c.name == run.__name__ for c in cases):
            raise ValueError(f"probe {probe} registers case {run.__name__} twice")
        cases.append(Case(probe, run.__name__, must_preserve, expect, run, beyond_upstream, proves, needs))
        return run

    return register


def cases_of(probe: str) -> list[Case]:
    """The registered cases of one probe (its module or package imported here so that its decorators run)."""
    import importlib

    importlib.import_module(f"{__name__}.cases.{probe}")
    return list(REGISTRY.get(probe, ()))


class ProbeContext:
    """Patches and environment changes scoped to one case.

    Every probe case swaps a few SGLang module globals for stand-ins (the
    transport class factory, the cache release helper, the TP rank lookup);
    the harness undoes them after the case so cases cannot leak into each
    other.
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def patch(self, obj: Any, name: str, value: Any) -> None:
        old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        setattr(obj, name, value)

        def undo() -> None:
            if old is _MISSING:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, old)

        self._undo.append(undo)

    def patch_if_present(self, obj: Any, name: str, value: Any) -> bool:
        if name not in getattr(obj, "__dict__", {}):
            return False
        self.patch(obj, name, value)
        return True

    def setenv(self, name: str, value: str | None) -> None:
        old = os.environ.get(name)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

        def undo() -> None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old

        self._undo.append(undo)

    def close(self) -> None:
        while self._undo:
            self._undo.pop()()
