"""`sglang-backport run` (the main job) and `sglang-backport verify` (check a bundle).

run SPEC: fetch the target, apply the pack on a fresh clone, probe the pristine tree, the
patched tree and the reference (upstream's newest pinned release that has every fix), run
upstream's own unit tests for the fixes, and write an evidence bundle. Exit 0 when no case
regressed or errored and every case outside the must-preserve set is fixed or held (or not
applicable); 1 otherwise (or when the series does not apply: then no bundle is written,
there is no patched tree to prove); 2 for bad input.

With --head SPEC the pack is not applied: SPEC is the base and the head is another tree
(upstream's own before/after commits of a fix, `patches/pairs.toml`).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from backport import cache, evidence
from backport.errors import BadInput, Finding

NONE_WORDS = ("none", "no", "off")


# ---- progress -----------------------------------------------------------------------------------


class Progress:
    """One line per step on stderr, with its duration; durations go to the receipt's timestamps."""

    def __init__(self, total: int):
        self.total = total
        self.index = 0
        self.steps: list[dict] = []

    def say(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    @contextmanager
    def step(self, name: str, message: str):
        self.index += 1
        self.say(f"[{self.index}/{self.total}] {message} ...")
        started = time.monotonic()
        try:
            yield
        finally:
            seconds = round(time.monotonic() - started, 3)
            self.steps.append({"step": name, "seconds": seconds})
        if seconds >= 2:
            self.say(f"      {name}: {seconds:.1f} s")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


# ---- inputs ---------------------------------------------------------------------------------------


def _kind(spec: str) -> str:
    from backport.sources import GitSource, InstalledSource, PathSource, WheelSource, parse_spec

    source = parse_spec(spec, allow_unpinned=True)
    return {WheelSource: "wheel", GitSource: "git", PathSource: "path", InstalledSource: "installed"}[type(source)]


def default_reference(pack, pins: dict | None = None) -> str | None:
    """The newest release pinned in targets.toml that every fix's `fixed_in` contains."""
    from packaging.version import Version

    from backport.sources import load_pins

    pins = load_pins() if pins is None else pins
    fixes = list(pack.fixes.values())
    if not fixes:
        return None
    versions = [v for v in pins if all(fix.is_fixed_in(v) for fix in fixes)]
    return f"sglang=={max(versions, key=Version)}" if versions else None


def default_bundle_dir(target, head=None) -> Path:
    """evidence/<target> under the current directory: sglang-0.5.19, git-<commit12>, path-<digest12>."""
    def name(tree, kind):
        if kind == "wheel":
            return f"sglang-{tree.version}"
        if kind == "git":
            return f"git-{(tree.base_commit or tree.tree_digest)[:12]}"
        return f"{kind}-{tree.version}-{tree.tree_digest[:12]}"

    base = name(*target)
    return Path.cwd() / "evidence" / (base if head is None else f"{base}..{name(*head)}")


def _tree_input(role: str, tree, *, tree_digest: str, commit: str | None) -> evidence.TreeInput:
    return evidence.TreeInput(role=role, spec=tree.spec, version=tree.version, tree_digest=tree_digest,
                              commit=commit, artifact_sha256=tree.artifact_sha256, unpinned=bool(tree.unpinned),
                              package_root=Path(tree.package_root), tree_path=Path(tree.path))


def _series_files(series: Path) -> list[dict]:
    files = []
    for name in ("series", "fixes.toml", "targets.toml", "pairs.toml"):
        path = series / name
        if path.is_file():
            files.append({"path": name, "sha256": evidence.sha256_file(path)})
    return files


def _patch_inputs(pack, report_json: dict) -> list[dict]:
    by_name = {pv.name: pv for variants in pack.variants.values() for pv in variants}
    patches = []
    for patch in report_json.get("patches", []):
        variant = patch.get("variant")
        if not variant:
            continue
        pv = by_name.get(variant)
        path = Path(pv.path) if pv is not None else pack.root / patch["fix"] / variant
        digest = evidence.sha256_file(path) if path.is_file() else patch.get("variant_sha256")
        if patch.get("variant_sha256") and digest != patch["variant_sha256"]:
            raise Finding(f"{path}: sha256 {digest} differs from the {patch['variant_sha256']} the engine applied")
        try:
            rel = path.resolve().relative_to(Path(pack.root).resolve()).as_posix()
        except ValueError:
            rel = path.name
        patches.append({"fix": patch["fix"], "variant": variant, "path": rel, "sha256": digest,
                        "status": patch.get("status")})
    return patches


def _is_user_checkout(spec: str) -> bool:
    path = Path(spec).expanduser()
    return path.is_dir() and (path / ".git").exists()


def _check_clean(tree) -> None:
    import git

    repo = git.Repo(tree.path)
    try:
        if repo.is_dirty(untracked_files=True, path=f"{tree.package_prefix}sglang"):
            raise BadInput(f"{tree.path}: uncommitted changes under {tree.package_prefix}sglang/; `run` proves "
                           f"the committed HEAD on a clone: commit or stash them first")
    finally:
        repo.close()


def _clone(source, work_root: Path):
    import git

    from backport.tree import Tree

    work_root.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f"sglang-{source.version}-", dir=work_root))
    git.Repo.clone_from(str(source.path), str(out)).close()
    return Tree(out.resolve(), source.package_prefix, source.version, source.spec, source.artifact_sha256,
                source.tree_digest, source.base_commit, source.unpinned)


# ---- run ----------------------------------------------------------------------------------------


def cmd_run(args) -> int:
    from backport import cli
    from backport.probeenv import ensure_env
    from backport.probing import run_harness
    from backport.tree import tree_digest

    started_at, started = _now(), time.monotonic()
    series_dir = Path(args.series) if args.series else cli.DEFAULT_SERIES
    pack = cli._pack(args)
    head_spec = args.head
    mode = "upstream-pair" if head_spec else "backport"
    fetch_args = SimpleNamespace(allow_unpinned=args.allow_unpinned, python=args.python, out=None,
                                 only=None, check=False, allow_dirty=False, series=args.series)
    reference_spec = args.reference
    if reference_spec and reference_spec.lower() in NONE_WORDS:
        reference_spec, reference_choice = None, "none"
    elif reference_spec:
        reference_choice = "given"
    else:
        reference_spec = default_reference(pack)
        reference_choice = "default: the newest pinned release whose version is in every fix's fixed_in"
    run_tests = not args.no_upstream_tests
    has_reference = reference_spec is not None
    # environment, fetch, [clone, apply], [fetch-reference], probes, [upstream-tests], bundle
    progress = Progress(total=2 + 2 * (mode == "backport") + has_reference + (2 + has_reference) + run_tests + 1)
    work: list[Path] = []
    try:
        with progress.step("environment", "probe environment"):
            python = str(ensure_env(args.python))

        with progress.step("fetch", f"fetching {args.spec}"):
            fetched = cli._fetch(args.spec, fetch_args)
            source = fetched.tree
            kind = _kind(args.spec)
            in_place = _is_user_checkout(args.spec)
            if in_place:
                _check_clean(source)
            pristine_digest = tree_digest(source.package_root)
            if not in_place and pristine_digest != source.tree_digest:
                raise Finding(f"{source.path}: the cached tree no longer matches its recorded digest "
                              f"{source.tree_digest} (now {pristine_digest}); remove the cache entry and fetch again")
            head_fetched = cli._fetch(head_spec, fetch_args).tree if head_spec else None
            out = Path(args.out) if args.out else default_bundle_dir(
                (source, kind), (head_fetched, _kind(head_spec)) if head_spec else None)
            evidence.check_bundle_target(out)

        trees = {"pristine": _tree_input("pristine", source, tree_digest=pristine_digest,
                                         commit=source.base_commit)}
        apply_json, patches = None, []
        if mode == "backport":
            with progress.step("clone", "cloning a fresh work tree"):
                if in_place:
                    clone = _clone(source, cache.cache_root() / "work")
                else:
                    clone, _ = cli.prepare_work_tree(args.spec, fetch_args)
                work.append(clone.path)
            with progress.step("apply", f"applying the series of {series_dir} to sglang {source.version}"):
                report = cli.apply_to(clone, pack, fetch_args)
                apply_json = report.to_json()
            if report.status == "failed":
                failed = [p for p in report.patches if p.status == "failed"]
                first = failed[0] if failed else None
                if args.json:
                    print(json.dumps({"result": "apply-failed", "bundle": None, "apply": apply_json},
                                     indent=2, sort_keys=True))
                raise Finding(f"{args.spec}: the series does not apply"
                              + (f": {first.fix} ({first.variant}) {first.reason}" if first else "")
                              + "; no bundle written (there is no patched tree to prove)")
            patches = _patch_inputs(pack, apply_json)
            trees["patched"] = _tree_input("patched", clone, tree_digest=tree_digest(clone.package_root),
                                           commit=report.head_commit)
        else:
            trees["patched"] = _tree_input("patched", head_fetched,
                                           tree_digest=tree_digest(head_fetched.package_root),
                                           commit=head_fetched.base_commit)

        if reference_spec is not None:
            with progress.step("fetch-reference", f"fetching the reference {reference_spec}"):
                ref_tree = cli._fetch(reference_spec, fetch_args).tree
                trees["reference"] = _tree_input("reference", ref_tree,
                                                 tree_digest=tree_digest(ref_tree.package_root),
                                                 commit=ref_tree.base_commit)

        probe_docs: dict[str, dict] = {}
        for role in evidence.ROLES:
            if role not in trees:
                continue
            t = trees[role]
            with progress.step(f"probe-{role}", f"probing the {role} tree (sglang {t.version})"):
                probe_docs[role] = run_harness(python, t.package_root, None, label=f"{role} ({t.spec})")

        upstream = {"skipped": "disabled with --no-upstream-tests", "trees": []}
        if run_tests:
            with progress.step("upstream-tests", "running upstream's unit tests for the fixes"):
                upstream = _upstream_tests(trees, series_dir, python, args.upstream_base_url)

        with progress.step("bundle", "writing the evidence bundle"):
            probe_env = evidence.interpreter_environment(python)
            environment = evidence.environment_record(probe_env, probe_docs)
            target = {"spec": args.spec, "kind": kind, "version": source.version,
                      "artifact_sha256": source.artifact_sha256,
                      "commit": source.base_commit if kind in ("git", "path") else None,
                      "unpinned": bool(source.unpinned), "head": head_spec}
            timestamps = {
                "started": started_at,
                "finished": _now(),
                "duration_seconds": round(time.monotonic() - started, 3),
                "steps": progress.steps,
                "paths": {"bundle": str(Path(out).absolute()), "probe_python": python,
                          "series": str(series_dir.resolve()), "cache": str(cache.cache_root()),
                          **{role: str(t.tree_path) for role, t in trees.items()}},
            }
            bundle = evidence.assemble(
                mode=mode, target=target, trees=trees, probe_docs=probe_docs, apply_report=apply_json,
                patches=patches, series_files=_series_files(series_dir), upstream_tests=upstream,
                environment=environment, toolkit=evidence.toolkit_info(), timestamps=timestamps,
                reference_choice=reference_choice,
                extra_paths=[(series_dir.resolve(), ""), (cache.cache_root(), "<cache>")])
            written = evidence.write_bundle(out, bundle)
    finally:
        if not args.keep_trees:
            for path in work:
                shutil.rmtree(path, ignore_errors=True)
        elif work:
            progress.say(f"kept the patched work tree: {work[0]}")

    summary = bundle.summary
    code = 0 if summary["result"] == "pass" else 1
    receipt_sha = hashlib.sha256(bundle.files[evidence.RECEIPT]).hexdigest()
    if args.json:
        print(json.dumps({"bundle": str(written), "result": summary["result"], "exit_code": code,
                          "receipt_sha256": receipt_sha, "summary": summary}, indent=2, sort_keys=True))
    else:
        print(_human_summary(bundle, written))
    return code


def _upstream_tests(trees: dict, series_dir: Path, python: str, base_url: str | None) -> dict:
    try:
        from backport import upstream_tests
    except ModuleNotFoundError as exc:
        if exc.name != "backport.upstream_tests":
            raise
        return {"skipped": "backport.upstream_tests is not available in this toolkit", "trees": []}
    refs = upstream_tests.load_refs(series_dir)
    if not refs:
        return {"skipped": "fixes.toml lists no upstream tests", "trees": []}
    labelled = [(role, trees[role].package_root) for role in evidence.ROLES if role in trees]
    return upstream_tests.run_upstream_tests(labelled, refs, python=python, base_url=base_url)


def _human_summary(bundle: evidence.Bundle, written: Path) -> str:
    p = bundle.statement["predicate"]
    roles = [r for r in evidence.ROLES if r in p["probes"]]
    lines = [f"{'case':58} " + " ".join(f"{r:14}" for r in roles) + " pair"]
    for row in p["cases"]:
        name = f"{row['probe']}/{row['case']}" + (" *" if row["must_preserve"] else "")
        mark = "  <- finding" if evidence.is_finding(row["pair"], row["must_preserve"]) else ""
        lines.append(f"{name:58} " + " ".join(f"{row['verdicts'].get(r)!s:14}" for r in roles)
                     + f" {row['pair']}{mark}")
    s = p["summary"]
    counts = ", ".join(f"{n} {v}" for v, n in s["pair_verdicts"].items() if n)
    lines.append(f"\n{s['result'].upper()}: {s['cases']} cases ({counts}); "
                 f"patched differs from reference in {s['reference_differences']}")
    lines.append(f"bundle: {written}  (check: sglang-backport verify {written})")
    return "\n".join(lines)


# ---- verify ---------------------------------------------------------------------------------------


def cmd_verify(args) -> int:
    result = evidence.verify(Path(args.bundle))
    if args.json:
        print(json.dumps(result.to_json(), indent=2, sort_keys=True))
    elif result.ok:
        s = result.summary or {}
        print(f"OK {args.bundle}: {len(result.files)} files match SHA256SUMS and the receipt; receipt consistent "
              f"(run result: {s.get('result')}, {s.get('cases')} cases)")
    else:
        first = result.first
        more = f" (+{len(result.problems) - 1} more)" if len(result.problems) > 1 else ""
        print(f"FAIL {first.file}: {first.kind}: {first.detail}{more}")
    return 0 if result.ok else 1


# ---- registration ---------------------------------------------------------------------------------


def register(sub) -> None:
    p = sub.add_parser("run", help="the main job: fetch, apply, probe pristine/patched/reference, write a bundle",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("spec", help="sglang==X | git+URL@SHA | PATH | installed")
    p.add_argument("--out", help="bundle directory (default: evidence/<target>/ under the current directory)")
    p.add_argument("--reference", metavar="SPEC",
                   help="the upstream-fixed tree to compare with, or 'none' (default: the newest pinned "
                        "release whose version is in every fix's fixed_in)")
    p.add_argument("--head", metavar="SPEC",
                   help="probe this tree as the head instead of applying the pack (upstream before/after pairs)")
    p.add_argument("--series", help="patch series directory (default: the pack shipped with the toolkit)")
    p.add_argument("--python", metavar="EXE",
                   help="probe interpreter (default: the cached probe environment); for the 'installed' spec "
                        "also the interpreter whose sglang is taken")
    p.add_argument("--allow-unpinned", action="store_true",
                   help="fetch a sglang==X that patches/targets.toml does not pin (recorded as unpinned)")
    p.add_argument("--upstream-base-url", metavar="URL", help="raw-file base URL for upstream's test files")
    p.add_argument("--no-upstream-tests", action="store_true", help="do not run upstream's unit tests")
    p.add_argument("--keep-trees", action="store_true", help="keep the patched work tree (path on stderr)")
    p.add_argument("--json", action="store_true", help="print one JSON document (summary and bundle path)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("verify", help="recompute every digest of an evidence bundle and re-check its receipt")
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)
