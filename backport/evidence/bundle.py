"""The evidence bundle: every file of a run, laid out in memory, then written atomically.

Layout (users and scripts depend on it)::

    receipt.json          the in-toto statement (statement.py): its subjects are the patched tree
                          and the exported files (artifacts.py); predicate.files lists every file below
                          by sha256, which the receipt points at instead of copying (table.py)
    REPORT.md             the receipt rendered (report.py)
    apply-report.json     the engine's report, normalised (absent when nothing was applied)
    probes/<role>.json    one tree's probe results, normalised
    upstream-tests.json   upstream's unit tests per tree, normalised
    standards.json, vex.openvex.json, sbom.cdx.json, vex.cdx.json
                          the VEX documents and what they add to the receipt (vex.py, cyclonedx.py,
                          cdxvex.py)
    export/               with `run --export`: the patched wheel and export/patches/NNNN-*.patch
    .sglang-backport-bundle   the marker: with receipt.json, what makes a directory a bundle
    SHA256SUMS            `sha256sum -c` form over every other file

Determinism: the files are a function of the inputs only. Everything volatile (wall-clock
times, durations, import times, absolute paths of temporary trees) lives in the receipt's one
``predicate.timestamps`` field.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from backport import cache
from backport.errors import BadInput
from backport.evidence.attestations import git_trees
from backport.evidence.layout import (
    APPLY_REPORT,
    MARKER,
    MARKER_BYTES,
    RECEIPT,
    REPORT,
    SUMS,
    UPSTREAM_TESTS,
    as_umask_allows,
    canonical_json,
    parse_sums,
    probe_file,
    sha256_bytes,
    sha256_file,
    sums_text,
)
from backport.evidence.live import live_file
from backport.evidence.record import RunRecord, TreeInput
from backport.evidence.report import render_report
from backport.evidence.scrub import normalise_document, normalise_probe
from backport.evidence.statement import PREDICATE_TYPE, build_statement
from backport.evidence.table import pointed
from backport.evidence.verdicts import ROLES
from backport.records import TreeProbe

from . import vex

log = logging.getLogger("backport.evidence")


@dataclass(frozen=True)
class Bundle:
    """`statement` is the attached one (statement.py), `files[RECEIPT]` what format 4 writes of it."""

    files: dict[str, bytes]
    statement: dict

    @property
    def summary(self) -> dict:
        return self.statement["predicate"]["summary"]


def _tree_paths(trees: dict[str, TreeInput]) -> list[tuple[Path, str]]:
    """A tree's top directory, where it is not its package root, becomes `<role>-tree`."""
    return [(t.tree_path, role + "-tree") for role in ROLES if (t := trees.get(role)) is not None
            and t.tree_path is not None and t.package_root != t.tree_path]


def assemble(record: RunRecord) -> Bundle:
    """Normalise the raw outputs of a run and lay out every file of its bundle (in memory).

    Each tree's package root becomes its role name and its top directory `<role>-tree`; the
    toolkit's own `probes` package becomes `probes`. `record.extra_paths` names every other absolute
    path the raw documents may hold, as (path, replacement) pairs, longest first; an empty
    replacement makes paths under it relative. This module guesses no path: the caller passes
    at least the series directory (``""``) and the cache root (``"<cache>"``), and any
    directory of its own that a document can name (the probing side names the probe package's
    folder `probes` before it returns a document: probing/harness.scrub_package_path).
    """
    extra_paths = list(record.extra_paths)
    git = git_trees(record.trees)  # once: the subjects and standards.json both name them
    trees = {role: dataclasses.replace(tree, git_tree=git.get(role)) for role, tree in record.trees.items()}
    timestamps = dict(record.timestamps)
    import_seconds = dict(timestamps.get("import_seconds") or {})
    paths = dict(timestamps.get("paths") or {})
    tree_paths = _tree_paths(trees)
    probes: dict[str, dict] = {}
    for role in ROLES:
        if role not in record.probes:
            continue
        tree = trees[role]
        root = tree.package_root or Path(record.probes[role].tree)
        doc, volatile = normalise_probe(record.probes[role].to_json(), role, root,
                                        [*extra_paths, *tree_paths])
        probes[role] = doc
        if "import_seconds" in volatile:
            import_seconds[role] = volatile["import_seconds"]
        paths.setdefault(role, str(root))
    timestamps["import_seconds"] = import_seconds
    timestamps["paths"] = paths
    replacements: list[tuple[str | Path, str]] = [
        *((t.package_root, role) for role, t in trees.items() if t.package_root), *tree_paths, *extra_paths
    ]
    apply_doc = normalise_document(record.apply_report, replacements)
    upstream = normalise_document(record.upstream_tests or {"skipped": "not run", "trees": []}, replacements)
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
    normalised = dataclasses.replace(record, trees=trees,
                                     probes={role: TreeProbe.from_json(doc) for role, doc in probes.items()},
                                     apply_report=apply_doc,
                                     upstream_tests=upstream, timestamps=timestamps)
    export, live = record.export, record.live

    files: dict[str, bytes] = {probe_file(role): canonical_json(doc) for role, doc in probes.items()}
    if apply_doc is not None:
        files[APPLY_REPORT] = canonical_json(apply_doc)
    files[UPSTREAM_TESTS] = canonical_json(upstream)
    if export is not None:
        files.update(export.files)
    files[MARKER] = MARKER_BYTES
    if live is not None:  # run --live: one measured document per role (evidence/live.py)
        files.update({live_file(role): canonical_json(result.to_json()) for role, result in live.items()})

    def statement_for(report: bytes | None) -> dict:
        digests = {name: sha256_bytes(data) for name, data in files.items()}
        digests[REPORT] = sha256_bytes(report) if report is not None else "0" * 64
        return build_statement(normalised, digests)

    # the VEX documents (vex.py): a function of the statement, which they do not change
    if record.vulnerabilities is not None:
        files.update(
            vex.bundle_files(statement_for(None), vex.standards_document(record.vulnerabilities, git))
        )
    # REPORT.md is rendered from the statement (which does not depend on its digest), then listed.
    report = render_report(statement_for(None)).encode()
    files[REPORT] = report
    statement = statement_for(report)
    files[RECEIPT] = canonical_json(pointed(statement))
    files[SUMS] = sums_text({name: sha256_bytes(data) for name, data in files.items()}).encode()
    return Bundle(files, statement)


# ---- where a bundle may go: never over what a user owns ------------------------------------------


def is_bundle(path: Path) -> bool:
    """A bundle this toolkit wrote: its marker and its receipt (a file named SHA256SUMS alone is not one)."""
    path = Path(path)
    marker = path / MARKER
    return (marker.is_file() and not marker.is_symlink() and marker.read_bytes() == MARKER_BYTES
            and (path / RECEIPT).is_file())


def _is_legacy_bundle(path: Path) -> bool:
    """A bundle of an earlier version (no marker): a receipt.json whose predicate type is ours."""
    try:
        statement = json.loads((path / RECEIPT).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(statement, dict) and statement.get("predicateType") == PREDICATE_TYPE


def check_bundle_target(out: Path, *, replace: bool = False) -> Path:
    """`out` as an absolute path, if a bundle may be written there (BadInput otherwise).

    A directory the toolkit did not write is never written into; an existing bundle is replaced
    only when `replace` (the default evidence/<target>/ directory, or `--force`).
    """
    out = Path(out).absolute()
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise BadInput(f"{out}: exists and is not a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return out
    if not (is_bundle(out) or _is_legacy_bundle(out)):
        raise BadInput(f"{out}: exists, is not empty and is not an evidence bundle (no {MARKER} beside a "
                       f"receipt.json); refusing to write into it, nothing was changed: give another --out")
    if not replace:
        raise BadInput(
            f"{out}: holds an evidence bundle already; pass --force to replace it (files the toolkit "
            f"did not write, a signature or notes, stay with the old bundle, moved aside) or give "
            f"another --out"
        )
    return out


def _own_files(out: Path) -> set[str] | None:
    """The names of the files in `out` that the toolkit wrote there and nobody changed since (SHA256SUMS
    and what it lists, digests matching); None when anything else is there (a signature, notes, an
    edited file, a link) or the bundle has no marker."""
    if not is_bundle(out):
        return None
    listed, _why = parse_sums((out / SUMS).read_bytes()) if (out / SUMS).is_file() else (None, None)
    if listed is None:
        return None
    own = {SUMS}
    for path in out.rglob("*"):
        if path.is_dir() and not path.is_symlink():
            continue
        name = path.relative_to(out).as_posix()
        if name == SUMS:
            continue
        if path.is_symlink() or listed.get(name) != sha256_file(path):
            return None
        own.add(name)
    return own


def _aside_name(out: Path) -> Path:
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    candidate = out.with_name(f"{out.name}.previous-{stamp}")
    number = 1
    while candidate.exists() or candidate.is_symlink():
        number += 1
        candidate = out.with_name(f"{out.name}.previous-{stamp}-{number}")
    return candidate


@dataclass(frozen=True)
class Written:
    path: Path
    previous: Path | None      # where the bundle that was at `path` was moved, whole (None: none kept)


def place_bundle(out: Path, bundle: Bundle, *, replace: bool = False) -> Written:
    """Write the bundle beside `out` under a temporary name, then swap it into place.

    Nothing a user owns is deleted. A directory that is not a bundle is never written into. An
    existing bundle (only when `replace`) is removed only when it holds nothing but the toolkit's
    own unchanged files and the new bundle rewrites every one of them; otherwise (a signature,
    a reviewer's notes, an export the new run does not make, an edited file) the old bundle is
    moved aside whole, beside `out`, and `previous` says where.
    """
    out = check_bundle_target(out, replace=replace)
    staged = cache.staging_dir(out)
    previous = None
    try:
        as_umask_allows(staged)  # mkdtemp's 0700 would keep the bundle from the group
        for name, data in bundle.files.items():
            target = staged / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        old = None
        if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
            # an empty folder (made for the bundle) holds nothing to keep aside; rmdir refuses one
            # that gained a file meanwhile, which is then kept aside whole below
            with contextlib.suppress(OSError):
                out.rmdir()
        if out.exists():
            own = _own_files(out)
            if own is not None and own <= set(bundle.files):
                old = staged.with_name(staged.name.replace(".partial", ".old"))
            else:
                old = previous = _aside_name(out)
            os.rename(out, old)
        try:
            os.rename(staged, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
        if old is not None and previous is None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    if previous is not None:
        log.warning("%s: the bundle that was there holds files this run does not rewrite; kept whole at %s",
                    out, previous)
    return Written(out, previous)


def write_bundle(out: Path, bundle: Bundle, *, replace: bool = False) -> Path:
    """`place_bundle`, for callers that need only the bundle's path."""
    return place_bundle(out, bundle, replace=replace).path
