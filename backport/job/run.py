"""The main job as a library: fetch, clone, apply, probe each role, upstream tests, bundle.

    outcome = run(RunOptions("sglang==0.5.19"))

Each step is a small function with typed inputs and outputs; `run` calls them in order, as
nox's workflow does with its tasks. The CLI only parses arguments, calls `run` and prints.
A release the pack cannot serve (a fix with no variant for it) makes an exposure run: no
patched tree is built, the pristine tree is probed alone and the bundle (mode `exposure`)
shows what the release, as shipped, stays exposed to (exit 1). A variant that exists but does
not place raises `SeriesDoesNotApply` (a finding: no patched tree to prove, no bundle).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from backport import cache, evidence
from backport.advisories import bundle_section
from backport.engine import ApplyReport, apply_series
from backport.errors import BadInput, Finding
from backport.evidence.vulnerabilities import pack_classes
from backport.job.coverage import EXCLUSIONS, measure, touched_files
from backport.job.live import live_documents
from backport.job.plan import Plan, RunOptions, bundle_dir, is_user_checkout, plan
from backport.job.progress import Progress
from backport.probing import ensure_env, run_matrix
from backport.records import TreeProbe
from backport.sources import clone_pristine, materialise
from backport.tree import Tree, clone_commit, decided_version, tree_digest
from backport.vocab import ApplyStatus, PatchStatus, RunResult

log = logging.getLogger("backport.job")


class SeriesDoesNotApply(Finding):
    def __init__(self, message: str, report: ApplyReport):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class RunOutcome:
    bundle: evidence.Bundle
    written: Path
    exit_code: int
    receipt_sha256: str
    previous: Path | None = None       # where the bundle that was at `written` was moved, whole

    @property
    def summary(self) -> dict:
        return self.bundle.summary


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


# ---- steps ------------------------------------------------------------------------------------


def fetch(spec: str, the_plan: Plan) -> Tree:
    options = the_plan.options
    return materialise(spec, allow_unpinned=options.allow_unpinned, python=options.python,
                       pins=the_plan.pins).tree


def check_pristine(the_plan: Plan, source: Tree) -> str:
    """The digest of the tree to prove (a user's checkout was checked when planned: sources/local.py)."""
    digest = tree_digest(source.package_root)
    if not the_plan.in_place and digest != source.tree_digest:
        raise Finding(f"{source.path}: the cached tree no longer matches its recorded digest "
                      f"{source.tree_digest} (now {digest}); remove the cache entry and fetch again")
    return digest


def pristine_source(the_plan: Plan, work: list[Path]) -> Tree:
    """The pristine tree to probe. A user's checkout: a fresh clone of the commit recorded when the
    run was planned, never its live work tree (an `apply` on it meanwhile changes nothing here).
    Other targets: the checked cache entry, with `--version` or the refusal of an unknown one."""
    options = the_plan.options
    if the_plan.checkout is not None:
        checkout = the_plan.checkout
        assert checkout.base_commit is not None  # plan() records the commit of every user checkout
        pristine = clone_commit(checkout, checkout.base_commit, cache.work_root())
        work.append(pristine.path)
        return pristine
    source = fetch(options.spec, the_plan)
    version = decided_version(source, options.version, "git" if the_plan.kind == "git" else "path")
    return source if version == source.version else dataclasses.replace(source, version=version)


def fetch_head(the_plan: Plan, work: list[Path]) -> Tree:
    """--head: a user's checkout is taken as a fresh clone of its HEAD commit, as the pristine one."""
    spec = the_plan.options.head
    assert spec is not None  # called for --head only
    head = fetch(spec, the_plan)
    if not is_user_checkout(spec):
        return head
    import git

    with git.Repo(head.path) as repo:
        commit = repo.head.commit.hexsha
    clone = clone_commit(head, commit, cache.work_root())
    work.append(clone.path)
    return clone


def check_probed(trees: dict[str, evidence.TreeInput], probes: dict[str, TreeProbe]) -> None:
    """Each recorded tree digest, taken again from the tree after it was probed (and run live and
    under upstream's tests): a tree that changed meanwhile is a finding, never a silent pass."""
    for role, tree in trees.items():
        probed = probes[role].tree if role in probes else None
        if probed and Path(probed).resolve() != tree.root().resolve():
            raise Finding(f"the {role} probes ran on {probed}, not on the recorded tree {tree.package_root}")
        now = tree_digest(tree.root())
        if now != tree.tree_digest:
            raise Finding(
                f"the {role} tree {tree.package_root} changed while it was probed: digest {now[:12]} "
                f"now, {tree.tree_digest[:12]} recorded; no bundle written"
            )


def clone(source: Tree) -> Tree:
    """A fresh clone of `source` under the cache's work/ (removed at the end unless kept)."""
    return clone_pristine(source, cache.work_root())


def apply_pack(the_plan: Plan, tree: Tree) -> ApplyReport:
    report = apply_series(tree.path, the_plan.pack, tree.version, package_prefix=tree.package_prefix)
    if report.status == ApplyStatus.FAILED:
        failed = [p for p in report.patches if p.status == PatchStatus.FAILED]
        first = failed[0] if failed else None
        what = "" if first is None else f": {first.fix} ({first.variant or 'no variant'}) {first.reason}"
        raise SeriesDoesNotApply(
            f"{the_plan.options.spec}: the series does not apply{what}; no bundle written "
            f"(there is no patched tree to prove)",
            report,
        )
    return report


def unserved(report: ApplyReport) -> bool:
    """The pack cannot serve the release (evidence.scope.unserved_fixes): an exposure run; any
    other failed apply is refused as before."""
    return evidence.unserved_fixes(report) is not None


def tree_input(
    role: str, tree: Tree, *, digest: str | None = None, commit: str | None = None
) -> evidence.TreeInput:
    return evidence.TreeInput(role=role, spec=tree.spec, version=tree.version,
                              tree_digest=digest or tree_digest(tree.package_root),
                              commit=commit if commit is not None else tree.base_commit,
                              artifact_sha256=tree.artifact_sha256, unpinned=bool(tree.unpinned),
                              package_root=Path(tree.package_root), tree_path=Path(tree.path))


def upstream_tests(trees: dict[str, evidence.TreeInput], series_dir: Path, python: str,
                   base_url: str | None, coverage_files: list[str] | None = None) -> dict:
    """Upstream's tests on every tree; on the patched tree under coverage of `coverage_files`."""
    from backport import upstream

    refs = upstream.load_refs(series_dir)
    if not refs:
        return {"skipped": "fixes.toml lists no upstream tests", "trees": []}
    labelled = [(role, trees[role].root()) for role in evidence.ROLES if role in trees]
    return upstream.run_upstream_tests(labelled, refs, python=python, base_url=base_url,
                                       coverage={"patched": coverage_files} if coverage_files else None)


def series_files(the_plan: Plan) -> list[dict]:
    """The pack's own files, and the release matrix whose pins fetched the trees (wherever it is)."""
    series = the_plan.series_dir
    # the coverage exclusions shape the bundle's coverage claims, so they are an input as the pack is
    order = ("series", "fixes.toml", "releases.toml", "pairs.toml", EXCLUSIONS)
    paths = {name: series / name for name in order if name != "releases.toml"}
    paths["releases.toml"] = the_plan.matrix
    return [{"path": name, "sha256": evidence.sha256_file(path)}
            for name, path in sorted(paths.items(), key=lambda item: order.index(item[0]))
            if path.is_file()]


def patch_inputs(the_plan: Plan, report: ApplyReport) -> list[dict]:
    pack = the_plan.pack
    by_name = {pv.name: pv for variants in pack.variants.values() for pv in variants}
    patches = []
    for patch in report.patches:
        variant = patch.variant
        if not variant:
            continue
        pv = by_name.get(variant)
        path = Path(pv.path) if pv is not None else pack.root / patch.fix / variant
        digest = evidence.sha256_file(path) if path.is_file() else patch.variant_sha256
        if patch.variant_sha256 and digest != patch.variant_sha256:
            raise Finding(
                f"{path}: sha256 {digest} differs from the {patch.variant_sha256} the engine applied"
            )
        try:
            rel = path.resolve().relative_to(Path(pack.root).resolve()).as_posix()
        except ValueError:
            rel = path.name
        patches.append({"fix": patch.fix, "variant": variant, "path": rel, "sha256": digest,
                        "status": patch.status})
    return patches


# ---- the workflow -----------------------------------------------------------------------------


@dataclass
class Prepared:
    """One target after fetch and apply: its trees by role, ready to probe and bundle."""

    plan: Plan
    progress: Progress
    started_at: str
    started: float
    source: Tree
    out: Path
    trees: dict[str, evidence.TreeInput]
    apply: ApplyReport | None  # the engine's report: apply-report.json (its to_json) in the bundle
    patches: list[dict]
    work: list[Path]
    mode: str = "backport"             # the plan's mode, or "exposure": the pack could not serve the release

    @property
    def exposure(self) -> bool:
        return self.mode == "exposure"


def prepare(the_plan: Plan, progress: Progress) -> Prepared:
    """Fetch the target (and head), clone, apply, fetch the reference: every tree of this run."""
    options = the_plan.options
    started_at, started = _now(), time.monotonic()
    work: list[Path] = []
    try:
        with progress.step("fetch", f"fetching {options.spec}"):
            source = pristine_source(the_plan, work)
            pristine_digest = check_pristine(the_plan, source)
            head = fetch_head(the_plan, work) if options.head else None
            out = Path(options.out) if options.out else bundle_dir(
                source, the_plan.kind, (head, the_plan.head_kind) if head else None, options.bundle_root)
            evidence.check_bundle_target(out, replace=options.replace_bundle)
        trees = {"pristine": tree_input("pristine", source, digest=pristine_digest)}
        applied: ApplyReport | None = None
        patches: list[dict] = []
        mode = the_plan.mode
        if head is None:
            with progress.step("clone", "cloning a fresh work tree"):
                patched = clone(source)
                work.append(patched.path)
            try:
                with progress.step(
                    "apply", f"applying the series of {the_plan.series_dir} to sglang {source.version}"
                ):
                    report = apply_pack(the_plan, patched)
            except SeriesDoesNotApply as refused:
                if not unserved(refused.report):
                    raise
                # No patched tree: the release is probed as shipped, to show what it stays exposed to.
                applied, mode = refused.report, "exposure"
                discard([patched.path], keep=False)
                work.remove(patched.path)
            else:
                applied = report
                patches = patch_inputs(the_plan, report)
                trees["patched"] = tree_input("patched", patched, commit=report.head_commit)
        else:
            trees["patched"] = tree_input("patched", head)
        if the_plan.reference_spec is not None and mode != "exposure":
            with progress.step("fetch-reference", f"fetching the reference {the_plan.reference_spec}"):
                trees["reference"] = tree_input("reference", fetch(the_plan.reference_spec, the_plan))
    except BaseException:
        discard(work, keep=False)
        raise
    return Prepared(
        the_plan, progress, started_at, started, source, out, trees, applied, patches, work, mode
    )


def probe_all(python: str, runs: list[Prepared], *, jobs: int | None = None) -> list[dict[str, TreeProbe]]:
    """Every tree of every run in one probe matrix (a tree shared by runs, the reference, once)."""
    roots = [t.root() for run in runs for t in run.trees.values()]
    labels = [f"{role} {t.version}" for run in runs for role, t in run.trees.items()]
    files = sorted({f for run in runs if not run.exposure for f in touched_files(run.apply)})
    first = runs[0].progress
    with first.step("probe", f"probing {len(set(roots))} tree(s) in one probe matrix"):
        documents = iter(run_matrix(python, roots, jobs=jobs, labels=labels, coverage=files,
                                    versions=[t.version for run in runs for t in run.trees.values()]))
    for run in runs[1:]:
        run.progress.index += 1
        run.progress.steps.append(dict(first.steps[-1]))
    return [{role: TreeProbe.from_json(next(documents)) for role in run.trees} for run in runs]


def export_files(run: Prepared) -> evidence.Exported | None:
    """`--export`: the patched tree as a wheel and a `git format-patch` series, for the bundle."""
    from backport.export import build_wheel, read_lineage, write_series

    if not run.plan.options.export:
        return None
    if run.exposure:
        log.warning("--export: the pack cannot serve %s; nothing to export", run.plan.options.spec)
        return None
    if not any(p.status == PatchStatus.APPLIED for p in (run.apply.patches if run.apply else ())):
        log.warning("--export: no patch applies to %s; nothing to export", run.plan.options.spec)
        return None
    tree_path = run.trees["patched"].tree_path
    assert tree_path is not None  # set for every tree a run builds
    lineage = read_lineage(tree_path)
    with tempfile.TemporaryDirectory(prefix="export-", dir=cache.work_root()) as tmp:
        wheel = build_wheel(lineage, Path(tmp) / "wheel")
        series = write_series(lineage, Path(tmp) / "patches")
        return evidence.export_of(wheel, wheel.path.read_bytes(),
                                  [(path.name, path.read_bytes()) for path in series],
                                  label=lineage.label, patch_set_sha256=lineage.patch_set_sha256)


def finish(run: Prepared, python: str, probes: dict[str, TreeProbe]) -> RunOutcome:
    """Upstream's tests (when asked), the live tier (when asked) and the bundle of one run."""
    the_plan, options, progress = run.plan, run.plan.options, run.progress
    live = None
    if options.live and run.exposure:
        log.warning("--live: not run on %s (an exposure run: no patched tree to compare)", options.spec)
    elif options.live:
        with progress.step("live", f"live tier: a PD deployment per tree ({len(run.trees)} trees)"):
            live = live_documents(run.trees, options.python)
    upstream = {"skipped": "disabled with --no-upstream-tests", "trees": []}
    if run.exposure:
        upstream = {"skipped": "an exposure run: the pack has no variant for this release, no patched tree "
                               "to test", "trees": []}
    elif options.upstream_tests:
        with progress.step("upstream-tests", "running upstream's unit tests for the fixes"):
            upstream = upstream_tests(run.trees, the_plan.series_dir, python, options.upstream_base_url,
                                      touched_files(run.apply))
    check_probed(run.trees, probes)
    # the patches' executed lines and the pristine functions the fixes change; drops the raw line lists
    coverage, probes = measure(run.trees, run.apply, the_plan.pack, probes, options.min_coverage, upstream)
    with progress.step("bundle", "writing the evidence bundle"):
        exported = export_files(run)
        source, trees = run.source, run.trees
        bundle = evidence.assemble(evidence.RunRecord(
            mode=run.mode,
            target={
                "spec": options.spec,
                "kind": the_plan.kind,
                "version": source.version,
                "artifact_sha256": source.artifact_sha256,
                "commit": source.base_commit if the_plan.kind in ("git", "path") else None,
                "unpinned": bool(source.unpinned),
                "head": options.head,
            },
            trees=trees,
            probes=probes,
            apply_report=None if run.apply is None else run.apply.to_json(),
            patches=run.patches,
            series_files=series_files(the_plan),
            upstream_tests=upstream,
            environment=evidence.environment_record(evidence.interpreter_environment(python)),
            toolkit=evidence.toolkit_info(),
            timestamps={
                "started": run.started_at,
                "finished": _now(),
                "duration_seconds": round(time.monotonic() - run.started, 3),
                "steps": progress.steps,
                "paths": {
                    "bundle": str(Path(run.out).absolute()),
                    "probe_python": python,
                    "series": str(the_plan.series_dir.resolve()),
                    "cache": str(cache.cache_root()),
                    **{role: str(t.tree_path) for role, t in trees.items()},
                },
            },
            reference_choice=None if run.exposure else the_plan.reference_choice,
            extra_paths=((the_plan.series_dir.resolve(), ""), (cache.cache_root(), "<cache>")),
            coverage=coverage,
            export=exported,
            live=live,
            vulnerabilities=pack_classes(the_plan.pack, the_plan.matrix, options.vuln_aliases),
            advisories=bundle_section(
                the_plan.pack, {role: (t.package_root, t.version) for role, t in trees.items()}
            ),
        ))
        placed = evidence.place_bundle(run.out, bundle, replace=options.replace_bundle)
    code = 0 if bundle.summary["result"] == RunResult.PASS else 1
    return RunOutcome(bundle, placed.path, code, hashlib.sha256(bundle.files[evidence.RECEIPT]).hexdigest(),
                      placed.previous)


def discard(work: list[Path], *, keep: bool) -> None:
    if keep:
        for path in work:
            log.warning("kept a work tree of this run: %s", path)
        return
    for path in work:
        shutil.rmtree(path, ignore_errors=True)


def run_many(many: list[RunOptions], *, jobs: int | None = None) -> list[RunOutcome]:
    """The main job for several targets: each fetched and patched, all probed in one matrix.

    Every input is checked before anything is fetched or built; a target the pack cannot serve
    gets an exposure bundle (its pristine tree only); a variant that does not place stops the
    whole call (SeriesDoesNotApply names it) and leaves no bundle.
    """
    plans = [plan(options) for options in many]
    outs = [p.options.out for p in plans if p.options.out is not None]
    if len(set(outs)) != len(outs):
        raise BadInput("two runs would write the same bundle directory (--out)")
    progress = [Progress(total=p.total_steps, target=p.options.spec) for p in plans]
    with progress[0].step("environment", "probe environment"):
        python = str(ensure_env(many[0].python))
    for other in progress[1:]:
        other.index += 1
    runs: list[Prepared] = []
    try:
        for the_plan, steps in zip(plans, progress, strict=True):
            runs.append(prepare(the_plan, steps))
        documents = probe_all(python, runs, jobs=jobs)
        return [finish(run, python, docs) for run, docs in zip(runs, documents, strict=True)]
    finally:
        for run in runs:
            discard(run.work, keep=run.plan.options.keep_trees)


def run(options: RunOptions) -> RunOutcome:
    """The main job. Raises BadInput (exit 2), SeriesDoesNotApply / Finding (exit 1); an exposure
    run returns exit 1."""
    return run_many([options])[0]
