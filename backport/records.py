"""Stage results that cross packages, where the producing package is heavy to import: the reader
(evidence/, at `verify`) takes the type without importing the producer (live/, ~300 ms of imports).

The live tier's result for one tree: a frozen record per tree and per scenario (live/tier.py).

`to_json` is the bundle's `live/<role>.json` (evidence/live.py reads it) and `live --json`'s per-tree
document; its keys do not change. `details` stays a mapping: what a scenario observed, its own shape
per scenario (a reply, the race's trials), recorded as it is and judged by nobody downstream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backport.vocab import TreeVerdict


@dataclass(frozen=True)
class ScenarioResult:
    scenario: str
    must_preserve: bool
    expect: str
    verdict: TreeVerdict
    observed: str
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"scenario": self.scenario, "must_preserve": self.must_preserve, "expect": self.expect,
                "verdict": self.verdict, "observed": self.observed, "details": self.details,
                "seconds": self.seconds}

    @classmethod
    def from_json(cls, doc: dict) -> ScenarioResult:
        """A row as to_json (or race.run_race, which speaks the same format) gives it."""
        return cls(scenario=doc["scenario"], must_preserve=doc["must_preserve"], expect=doc["expect"],
                   verdict=TreeVerdict(doc["verdict"]), observed=doc["observed"],
                   details=doc.get("details") or {}, seconds=doc.get("seconds", 0.0))


@dataclass(frozen=True)
class LiveResult:
    """One tree's deployment and its scenarios. `server`: version, setup, flags, backend, router,
    model_sha256 (what answered, as the deployment reported it)."""

    tree: str
    version: str
    startup_seconds: float
    server: dict[str, Any]
    scenarios: tuple[ScenarioResult, ...]

    @property
    def broke(self) -> bool:
        """A scenario could not judge the tree (a deployment to try again, not a verdict to keep)."""
        return any(s.verdict == TreeVerdict.ERROR for s in self.scenarios)

    def to_json(self) -> dict:
        return {"tree": self.tree, "version": self.version, "startup_seconds": self.startup_seconds,
                "server": self.server, "scenarios": [s.to_json() for s in self.scenarios]}

    @classmethod
    def from_json(cls, doc: dict) -> LiveResult:
        scenarios = tuple(ScenarioResult.from_json(s) for s in doc["scenarios"])
        return cls(tree=doc["tree"], version=doc["version"], startup_seconds=doc["startup_seconds"],
                   server=doc["server"], scenarios=scenarios)
