"""Differential probes of sglang-backport.

CPU scenarios that import the real SGLang modules of ONE tree (the only
``sglang`` on ``sys.path``) and drive them through the steps of the 2026 PD
cross-request KV exposure. Each probe module lists named cases; each case
states the safe behaviour and reports what it observed.

This package runs inside the probe virtualenv, never in the toolkit's: it uses
only the standard library, torch and the tree under test. It never imports
``backport``. Entry point: ``python -m probes.harness --tree PKGROOT``.

The shared case machinery lives here (not in ``harness``) because the harness
runs as ``__main__``: probe modules importing ``probes.harness`` would get a
second copy of these classes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROBE_NAMES = ("admission", "prefill_retire", "handoff", "page_lifetime")

SAFE = "safe"
UNSAFE = "unsafe"
ERROR = "error"
NOT_APPLICABLE = "not-applicable"

_MISSING = object()


class NotApplicable(Exception):
    """Raised by a case whose target code does not exist in the tree."""


@dataclass
class Outcome:
    verdict: str
    observed: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Case:
    name: str
    must_preserve: bool
    expect: str
    run: Callable[[ProbeContext], Outcome]


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
