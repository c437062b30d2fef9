"""What `verify` finds: one problem per file, and the result of checking one bundle."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KINDS = ("modified", "missing", "unexpected", "inconsistent")


@dataclass(frozen=True)
class Problem:
    file: str
    kind: str  # one of KINDS
    detail: str

    def to_json(self) -> dict:
        return {"file": self.file, "kind": self.kind, "detail": self.detail}

    def __str__(self) -> str:
        return f"{self.file}: {self.kind} ({self.detail})"


@dataclass(frozen=True)
class VerifyResult:
    bundle: Path
    files: dict[str, str]  # name -> sha256 as found
    problems: tuple[Problem, ...] = ()
    summary: dict | None = None  # the receipt's summary, when the bundle verifies

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def first(self) -> Problem | None:
        return self.problems[0] if self.problems else None

    def to_json(self) -> dict:
        return {
            "bundle": str(self.bundle),
            "ok": self.ok,
            "files": len(self.files),
            "first": self.first.to_json() if self.first else None,
            "problems": [p.to_json() for p in self.problems],
            "summary": self.summary,
        }
