"""What the engine reports: per hunk, per patch, per run (frozen until to_json).

``ApplyReport.to_json`` is the CLI's ``apply --json`` document and the
bundle's ``apply-report.json``; its keys do not change. ``recovery`` is set
only when the run first finished or rolled back an interrupted apply, and
appears in the JSON only then.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..vocab import ApplyStatus, Cause, HunkStatus, PatchStatus
from .placement import CONFLICT

# The short names the engine's modules use (backport/vocab.py holds the vocabularies).
APPLIED, PRESENT, NOT_APPLICABLE, FAILED = (PatchStatus.APPLIED, PatchStatus.PRESENT,
                                            PatchStatus.NOT_APPLICABLE, PatchStatus.FAILED)
NOTHING_TO_DO = ApplyStatus.NOTHING_TO_DO
# Why a patch failed or does not apply, as a value (readers never parse `reason`: prose for people).
NO_VARIANT, MISSING_DEPENDENCY = Cause.NO_VARIANT, Cause.MISSING_DEPENDENCY
DOES_NOT_PLACE = Cause.DOES_NOT_PLACE
SHIPPED, OUT_OF_SCOPE = Cause.SHIPPED, Cause.OUT_OF_SCOPE
REPORT_SCHEMA = "sglang-backport/apply-report/1"


@dataclass(frozen=True)
class HunkResult:
    file: str  # path relative to the package root, as in the patch
    status: HunkStatus
    offset: int = 0  # line delta from the line the hunk header states
    fuzz: int = 0
    line: int = 0  # 1-based line where the hunk went (conflict: nearest candidate; 0: file-level)
    expected: list[str] | None = None  # conflicts only: the hunk's old lines
    actual: list[str] | None = None  # conflicts only: the file's lines at `line`
    reason: str = ""

    def to_json(self) -> dict:
        d = {"file": self.file, "status": self.status, "offset": self.offset, "fuzz": self.fuzz,
             "line": self.line}
        if self.status == CONFLICT:
            d.update(reason=self.reason, expected=self.expected, actual=self.actual)
        return d

    @classmethod
    def from_json(cls, doc: dict) -> HunkResult:
        return cls(file=doc["file"], status=HunkStatus(doc["status"]), offset=doc.get("offset", 0),
                   fuzz=doc.get("fuzz", 0), line=doc.get("line", 0), expected=doc.get("expected"),
                   actual=doc.get("actual"), reason=doc.get("reason", ""))


@dataclass(frozen=True)
class PatchResult:
    fix: str
    variant: str | None  # patch file name
    status: PatchStatus
    reason: str = ""
    hunks: tuple[HunkResult, ...] = ()
    commit: str | None = None
    variant_sha256: str | None = None
    cause: Cause | None = None  # failed and not-applicable only

    def to_json(self) -> dict:
        d = {"fix": self.fix, "variant": self.variant, "variant_sha256": self.variant_sha256,
             "status": self.status, "reason": self.reason, "commit": self.commit,
             "hunks": [h.to_json() for h in self.hunks]}
        if self.cause:  # failed and not-applicable only (reports written before it lack it)
            d["cause"] = self.cause
        return d

    @classmethod
    def from_json(cls, doc: dict) -> PatchResult:
        """A patch of a report read back. Reports written before `cause` say a failure's cause by
        their shape: no variant; a variant not tried (no hunk): a missing dependency; else it did not
        place. A cause this reader does not know (a later toolkit's) reads as not placing: a defect
        of the pack, never "the pack cannot serve this release"."""
        status = PatchStatus(doc["status"])
        hunks = tuple(HunkResult.from_json(h) for h in doc.get("hunks") or ())
        cause: Cause | None = None
        if doc.get("cause"):
            cause = Cause(doc["cause"]) if doc["cause"] in set(Cause) else DOES_NOT_PLACE
        elif status == FAILED:
            cause = NO_VARIANT if not doc.get("variant") else DOES_NOT_PLACE if hunks else MISSING_DEPENDENCY
        return cls(fix=doc["fix"], variant=doc.get("variant"), status=status, reason=doc.get("reason", ""),
                   hunks=hunks, commit=doc.get("commit"), variant_sha256=doc.get("variant_sha256"),
                   cause=cause)


@dataclass(frozen=True)
class ApplyReport:
    tree: str
    version: str
    base_commit: str
    head_commit: str
    status: ApplyStatus
    patches: tuple[PatchResult, ...]
    check: bool = False
    package_prefix: str = ""
    recovery: str = ""  # what this run did first about an interrupted apply ("" = nothing)

    @property
    def exit_code(self) -> int:
        return 1 if self.status == ApplyStatus.FAILED else 0

    def to_json(self) -> dict:
        """The report as a dict ready for ``json.dumps``::

            {"schema": "sglang-backport/apply-report/1",
             "tree": "/abs/path", "version": "0.5.19", "package_prefix": "",
             "check": false,                      # true: nothing was written
             "base_commit": SHA, "head_commit": SHA,   # equal unless applied
             "status": "applied" | "nothing-to-do" | "failed",
             "patches": [{"fix": "pr38935", "variant": "pr38935-0.5.17.patch" | null,
                          "variant_sha256": HEX | null,
                          "status": "applied" | "already-present" | "not-applicable" | "failed",
                          "reason": "...",             # why, for every status but applied
                          "commit": SHA | null,        # the patch's commit when applied
                          "hunks": [{"file": "sglang/srt/...", "status": "exact" | "offset"
                                     | "fuzz" | "conflict", "offset": INT, "fuzz": 0..2,
                                     "line": INT,       # 1-based; 0 = the file as a whole
                                     # conflicts only:
                                     "reason": "...", "expected": [lines], "actual": [lines]}]}],
             "recovery": "..."}                   # only when an interrupted apply was recovered first
        """
        doc = {"schema": REPORT_SCHEMA, "tree": self.tree, "version": self.version,
               "package_prefix": self.package_prefix, "check": self.check,
               "base_commit": self.base_commit, "head_commit": self.head_commit,
               "status": self.status, "patches": [p.to_json() for p in self.patches]}
        if self.recovery:
            doc["recovery"] = self.recovery
        return doc

    @classmethod
    def from_json(cls, doc: dict) -> ApplyReport:
        """The report read back from apply-report.json or a receipt's `apply` (any bundle format)."""
        return cls(tree=doc.get("tree", ""), version=doc.get("version", ""),
                   base_commit=doc.get("base_commit", ""), head_commit=doc.get("head_commit", ""),
                   status=ApplyStatus(doc["status"]),
                   patches=tuple(PatchResult.from_json(p) for p in doc.get("patches") or ()),
                   check=bool(doc.get("check", False)), package_prefix=doc.get("package_prefix", ""),
                   recovery=doc.get("recovery", ""))
