"""The record of one run as the evidence stage takes it: what `bundle.assemble` lays out and
`statement.build_statement` states, one frozen value instead of sixteen keyword arguments.

The probe results are `TreeProbe` records (records.py); the fields that are JSON documents already
(the target, timestamps, the apply report as `ApplyReport.to_json` gives it, the upstream-test
document) stay documents here: they are written to the bundle as they are (normalised by scrub.py),
and their shape is the bundle's (schemas/).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from backport.evidence.artifacts import Exported
from backport.evidence.environment import Environment, Toolkit
from backport.evidence.vulnerabilities import VulnClass
from backport.records import LiveResult, TreeProbe


@dataclass(frozen=True)
class TreeInput:
    """One probed tree as the receipt records it (paths are for normalisation only)."""

    role: str
    spec: str
    version: str
    tree_digest: str
    commit: str | None = None
    artifact_sha256: str | None = None
    unpinned: bool = False
    git_tree: str | None = None  # its sglang/'s git tree id (attestations.git_tree); None: not a git tree
    package_root: Path | None = None
    tree_path: Path | None = None

    def root(self) -> Path:
        """The package root of a tree this run built (always set then; optional for a receipt read back)."""
        assert self.package_root is not None, f"{self.role}: no package root"
        return self.package_root

    def to_input(self) -> dict:
        return {"spec": self.spec, "version": self.version, "tree_digest": self.tree_digest,
                "commit": self.commit, "artifact_sha256": self.artifact_sha256, "unpinned": self.unpinned,
                "git_tree": self.git_tree}


@dataclass(frozen=True)
class RunRecord:
    """One run's outputs. `assemble` takes it raw (absolute paths, volatile fields in the documents)
    and hands `build_statement` the normalised one (the same type: `dataclasses.replace`).

    `extra_paths` names every other absolute path the raw documents may hold, as (path, replacement)
    pairs, longest first (see `assemble`). `live`: the live tier's result per role (records.py),
    when the run had one. `vulnerabilities`: the pack's classes for the VEX documents (vex.py)."""

    mode: str
    target: dict
    trees: dict[str, TreeInput]
    probes: dict[str, TreeProbe]
    apply_report: dict | None
    patches: list[dict]
    series_files: list[dict]
    upstream_tests: dict | None
    environment: Environment
    toolkit: Toolkit
    timestamps: dict
    reference_choice: str | None = None
    extra_paths: tuple[tuple[str | Path, str], ...] = ()
    coverage: dict | None = None
    export: Exported | None = None
    vulnerabilities: list[VulnClass] | None = None
    live: dict[str, LiveResult] | None = None
    advisories: dict | None = None
