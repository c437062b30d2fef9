"""The evidence bundle: every file of a run, laid out in memory, then written atomically.

Layout (users and scripts depend on it)::

    receipt.json          the in-toto statement (statement.py): its subjects are the patched tree
                          and the exported files (artifacts.py); predicate.files lists every file below
    REPORT.md             the receipt rendered (report.py)
    apply-report.json     the engine's report, normalised (absent when nothing was applied)
    probes/<role>.json    one tree's probe results, normalised
    upstream-tests.json   upstream's unit tests per tree, normalised
    export/               with `run --export`: the patched wheel and export/patches/NNNN-*.patch
    SHA256SUMS            `sha256sum -c` form over every other file

Determinism: the files are a function of the inputs only. Everything volatile (wall-clock
times, durations, import times, absolute paths of temporary trees) lives in the receipt's one
``predicate.timestamps`` field.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from backport import cache
from backport.errors import BadInput
from backport.evidence.artifacts import Exported
from backport.evidence.layout import (
    APPLY_REPORT,
    RECEIPT,
    REPORT,
    SUMS,
    UPSTREAM_TESTS,
    canonical_json,
    probe_file,
    sha256_bytes,
    sums_text,
)
from backport.evidence.live import live_file
from backport.evidence.live import section as live_section
from backport.evidence.report import render_report
from backport.evidence.scrub import normalise_document, normalise_probe
from backport.evidence.statement import TreeInput, build_statement
from backport.evidence.verdicts import ROLES


@dataclass(frozen=True)
class Bundle:
    files: dict[str, bytes]
    statement: dict

    @property
    def summary(self) -> dict:
        return self.statement["predicate"]["summary"]


def _tree_paths(trees: dict[str, TreeInput]) -> list[tuple[Path, str]]:
    """A tree's top directory, where it is not its package root, becomes `<role>-tree`."""
    return [(t.tree_path, role + "-tree") for role in ROLES if (t := trees.get(role)) is not None
            and t.tree_path is not None and t.package_root != t.tree_path]


def assemble(*, mode: str, target: dict, trees: dict[str, TreeInput], probe_docs: dict[str, dict],
             apply_report: dict | None, patches: list[dict], series_files: list[dict],
             upstream_tests: dict | None, environment: dict, toolkit: dict, timestamps: dict,
             reference_choice: str | None = None, extra_paths: Iterable[tuple[str | Path, str]] = (),
             coverage: dict | None = None, export: Exported | None = None,
             live: dict[str, dict] | None = None) -> Bundle:
    """Normalise the raw outputs of a run and lay out every file of its bundle (in memory).

    Each tree's package root becomes its role name and its top directory `<role>-tree`; the
    toolkit's own `probes` package becomes `probes`. `extra_paths` names every other absolute
    path the raw documents may hold, as (path, replacement) pairs, longest first; an empty
    replacement makes paths under it relative. This module guesses no path: the caller passes
    at least the series directory (``""``) and the cache root (``"<cache>"``), and any
    directory of its own that a document can name (the probing side replaces the temporary
    link through which the harness imported `probes` before it returns a document; a caller
    that keeps such a link passes ``(link, "probes")``).
    """
    extra_paths = list(extra_paths)
    timestamps = dict(timestamps)
    import_seconds = dict(timestamps.get("import_seconds") or {})
    paths = dict(timestamps.get("paths") or {})
    tree_paths = _tree_paths(trees)
    probes: dict[str, dict] = {}
    for role in ROLES:
        if role not in probe_docs:
            continue
        tree = trees[role]
        root = tree.package_root or Path(probe_docs[role].get("tree", "/"))
        doc, volatile = normalise_probe(probe_docs[role], role, root, extra_paths + tree_paths)
        probes[role] = doc
        if "import_seconds" in volatile:
            import_seconds[role] = volatile["import_seconds"]
        paths.setdefault(role, str(root))
    timestamps["import_seconds"] = import_seconds
    timestamps["paths"] = paths
    replacements = [(t.package_root, role) for role, t in trees.items() if t.package_root] + tree_paths + extra_paths
    apply_doc = normalise_document(apply_report, replacements)
    upstream = normalise_document(upstream_tests or {"skipped": "not run", "trees": []}, replacements)
    upstream.setdefault("skipped", None)
    upstream.setdefault("trees", [])
    # Where a test file came from (the network, a checkout, the cache) changes from run to run;
    # what it is (path, rev, sha256) does not.
    sources = {}
    for item in upstream.get("files") or []:
        if isinstance(item, dict) and "source" in item:
            source = item.pop("source")
            if source is not None:
                sources[f"{item.get('path')}@{item.get('rev')}"] = source
    if sources:
        timestamps["upstream_test_sources"] = sources

    files: dict[str, bytes] = {probe_file(role): canonical_json(doc) for role, doc in probes.items()}
    if apply_doc is not None:
        files[APPLY_REPORT] = canonical_json(apply_doc)
    files[UPSTREAM_TESTS] = canonical_json(upstream)
    if export is not None:
        files.update(export.files)
    if live is not None:  # run --live: one measured document per role (evidence/live.py)
        files.update({live_file(role): canonical_json(doc) for role, doc in live.items()})

    def statement_for(report: bytes | None) -> dict:
        digests = {name: sha256_bytes(data) for name, data in files.items()}
        digests[REPORT] = sha256_bytes(report) if report is not None else "0" * 64
        return build_statement(
            mode=mode, target=target, trees=trees, probes=probes, apply_report=apply_doc, patches=patches,
            series_files=series_files, upstream_tests=upstream, environment=environment, toolkit=toolkit,
            files=digests, timestamps=timestamps, reference_choice=reference_choice, coverage=coverage,
            export=None if export is None else export.record, live=None if live is None else live_section(live))

    # REPORT.md is rendered from the statement (which does not depend on its digest), then listed.
    report = render_report(statement_for(None)).encode()
    files[REPORT] = report
    statement = statement_for(report)
    files[RECEIPT] = canonical_json(statement)
    files[SUMS] = sums_text({name: sha256_bytes(data) for name, data in files.items()}).encode()
    return Bundle(files, statement)


def _looks_like_bundle(path: Path) -> bool:
    return (path / RECEIPT).is_file() or (path / SUMS).is_file()


def check_bundle_target(out: Path) -> Path:
    """`out` as an absolute path, if a bundle may be written there (BadInput otherwise)."""
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not _looks_like_bundle(out):
        raise BadInput(f"{out}: exists, is not empty and is not an evidence bundle; refusing to replace it")
    return out


def write_bundle(out: Path, bundle: Bundle) -> Path:
    """Write the bundle beside `out` under a temporary name, then swap it into place.

    An existing bundle at `out` is replaced only after the new one is complete; a directory
    that is not a bundle (no receipt.json, no SHA256SUMS) and is not empty is never replaced.
    """
    out = check_bundle_target(out)
    staged = cache.staging_dir(out)
    try:
        for name, data in bundle.files.items():
            target = staged / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        old = None
        if out.exists():
            old = staged.with_name(staged.name.replace(".partial", ".old"))
            os.rename(out, old)
        try:
            os.rename(staged, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return out
