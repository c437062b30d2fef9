"""Stage results that cross packages, where the producing package is heavy to import: the reader
(evidence/, at `verify`) takes the type without importing the producer (live/, ~300 ms of imports).

The live tier's result for one tree: a frozen record per tree and per scenario (live/tier.py). The
probe harness's result for one tree (`TreeProbe`, a `CaseResult` per case): the job's record of what
the probes said, written as probes/<role>.json.

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


@dataclass(frozen=True)
class CaseResult:
    """One case on one tree as the probe harness reports it (probes/<role>.json's `cases[]`)."""

    probe: str
    case: str
    must_preserve: bool
    expect: str
    observed: str
    verdict: TreeVerdict
    details: dict[str, Any] = field(default_factory=dict)
    beyond_upstream: bool = False  # written only when set (every other case document stays as it was)

    def to_json(self) -> dict:
        doc = {"probe": self.probe, "case": self.case, "must_preserve": self.must_preserve,
               "expect": self.expect, "observed": self.observed, "verdict": self.verdict,
               "details": self.details}
        if self.beyond_upstream:
            doc["beyond_upstream"] = True
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> CaseResult:
        return cls(probe=doc["probe"], case=doc["case"], must_preserve=doc["must_preserve"],
                   expect=doc["expect"], observed=doc["observed"], verdict=TreeVerdict(doc["verdict"]),
                   details=doc.get("details") or {}, beyond_upstream=bool(doc.get("beyond_upstream", False)))


# the probe harness's document (probes/runtime/harness.py): every key, and those it writes only when set
_PROBE_KEYS = {"tree", "version", "sglang_file", "python", "torch", "import_seconds", "cases"}
_PROBE_OPTIONAL = {"import_seconds", "coverage", "coverage_unavailable"}


@dataclass(frozen=True)
class TreeProbe:
    """One tree's probe result: the harness's document as the job hands it on (the run record, then
    probes/<role>.json). `import_seconds` is None once the bundle moved it to its timestamps; `coverage`
    (per file: statements, executed, the lines each case ran) None once the coverage measure took it."""

    tree: str
    version: str
    sglang_file: str | None
    python: str | None
    torch: str | None
    cases: tuple[CaseResult, ...]
    import_seconds: float | None = None
    coverage: dict[str, Any] | None = None
    coverage_unavailable: str | None = None

    def to_json(self) -> dict:
        doc: dict[str, Any] = {"tree": self.tree, "version": self.version, "sglang_file": self.sglang_file,
                               "python": self.python, "torch": self.torch,
                               "cases": [c.to_json() for c in self.cases]}
        for key in sorted(_PROBE_OPTIONAL):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> TreeProbe:
        """The harness's document; a key it does not know is refused (a record never drops what the
        harness wrote: the bundle would lose it silently)."""
        unknown = set(doc) - _PROBE_KEYS - _PROBE_OPTIONAL
        missing = _PROBE_KEYS - _PROBE_OPTIONAL - set(doc)
        if unknown or missing:
            raise ValueError(f"a probe document with keys {sorted(unknown)} unknown, {sorted(missing)} "
                             f"missing")
        return cls(tree=doc["tree"], version=doc["version"], sglang_file=doc["sglang_file"],
                   python=doc["python"], torch=doc["torch"],
                   cases=tuple(CaseResult.from_json(c) for c in doc["cases"]),
                   import_seconds=doc.get("import_seconds"), coverage=doc.get("coverage"),
                   coverage_unavailable=doc.get("coverage_unavailable"))
