"""Evidence: pair verdicts, the receipt (an in-toto Statement v1), bundles, and `verify`.

A run probes up to three trees, each under a role name: ``pristine`` (the target as
upstream shipped it), ``patched`` (the same tree with the pack applied) and
``reference`` (upstream's release that has every fix). The pair is pristine -> patched.

Pair verdict per case (base = pristine, head = patched):

==================  =========  =============  =========  ================
base \\ head        safe       unsafe         error      not-applicable
==================  =========  =============  =========  ================
safe                held       regressed      error      error
unsafe              fixed      still-unsafe   error      error
error               error      error          error      error
not-applicable      added      regressed      error      not-applicable
==================  =========  =============  =========  ================

* ``error`` is a finding, never safe: the probe could not judge the tree. A case that a
  tree did not report at all counts as ``error`` too, and so does a case that becomes
  not-applicable on head while it ran on base (the patch removed the code it drives).
* ``not-applicable`` (on both): the code path the case drives exists in neither tree
  (for example a later release's feature); not a finding, listed in the report.
* ``added``: the code path is absent on base and safe on head; not a finding.

A run passes when no case is ``regressed`` or ``error`` and no case outside the
must-preserve set is ``still-unsafe``. Must-preserve cases (valid, retracted, preempted,
re-entering requests) must not regress; they are ``held`` in a healthy run.

The reference check compares the patched verdict with the reference verdict per case and
lists every difference. It is information for the reviewer (the reference may lack a fix
that no release has yet, or carry later changes), not a pass/fail criterion.

Determinism: the bundle's files are a function of the inputs only. Everything volatile
(wall-clock times, durations, import times, absolute paths of temporary trees) lives in the
receipt's one ``predicate.timestamps`` field; probe outputs are normalised before they are
hashed (tree paths become role names, ``sglang_file`` is relative to the package root,
``import_seconds`` moves to ``timestamps``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backport import __version__, cache
from backport.errors import BadInput

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://sglang-backport.dev/receipt/v1"
SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "evidence" / "receipt.schema.json"
TOOLKIT_ROOT = Path(__file__).resolve().parent.parent

ROLES = ("pristine", "patched", "reference")
BASE, HEAD, REFERENCE = ROLES
TREE_VERDICTS = ("safe", "unsafe", "error", "not-applicable")
PAIR_VERDICTS = ("fixed", "held", "still-unsafe", "regressed", "added", "not-applicable", "error")
PASSING = {"fixed", "held", "added", "not-applicable"}

RECEIPT = "receipt.json"
SUMS = "SHA256SUMS"
REPORT = "REPORT.md"
APPLY_REPORT = "apply-report.json"
UPSTREAM_TESTS = "upstream-tests.json"

# Packages whose versions decide how SGLang's modules behave on a CPU (probes/requirements-cpu.txt).
KEY_PACKAGES = ("torch", "transformers", "tokenizers", "triton", "numpy", "xgrammar", "apache-tvm-ffi",
                "compressed-tensors", "pydantic", "pytest")
TOOLKIT_PACKAGES = ("gitpython", "unidiff", "packaging", "requests")

_PAIR_TABLE = {
    ("safe", "safe"): "held",
    ("safe", "unsafe"): "regressed",
    ("unsafe", "safe"): "fixed",
    ("unsafe", "unsafe"): "still-unsafe",
    ("not-applicable", "safe"): "added",
    ("not-applicable", "unsafe"): "regressed",
    ("not-applicable", "not-applicable"): "not-applicable",
}


def pair_verdict(base: str | None, head: str | None) -> str:
    """The pair verdict of one case from its base and head verdicts (None: the tree did not report it)."""
    return _PAIR_TABLE.get((base, head), "error")


def is_finding(pair: str, must_preserve: bool) -> bool:
    if pair in ("regressed", "error"):
        return True
    return pair == "still-unsafe" and not must_preserve


# ---- canonical bytes and digests ----------------------------------------------------------------


def canonical_json(document: Any) -> bytes:
    """The one serialisation every bundle file uses: sorted keys, fixed separators, ASCII, LF."""
    return (json.dumps(document, indent=2, sort_keys=True, separators=(",", ": "), ensure_ascii=True)
            + "\n").encode()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def sums_text(digests: dict[str, str]) -> str:
    """`sha256sum` output for these files, sorted by name (the form `sha256sum -c` reads)."""
    return "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))


# ---- normalisation ------------------------------------------------------------------------------


_PROBE_LINK = re.compile(r"/[^\s\"':]*?/sglang-backport-probes-[A-Za-z0-9_]+/probes")


class Scrubber:
    """Replace absolute paths in every string of a JSON value (longest path first)."""

    def __init__(self, replacements: Iterable[tuple[str | Path, str]]):
        pairs: dict[str, str] = {}
        for path, name in replacements:
            if path is None:
                continue
            for variant in {str(path), os.path.realpath(str(path))}:
                variant = variant.rstrip("/")
                if len(variant) > 1:
                    pairs.setdefault(variant, name)
        self.pairs = sorted(pairs.items(), key=lambda item: -len(item[0]))

    def text(self, value: str) -> str:
        value = _PROBE_LINK.sub("probes", value)
        for path, name in self.pairs:
            if path in value:
                if name:
                    value = value.replace(path, name)
                else:  # make relative: drop the directory and its separator
                    value = value.replace(path + "/", "").replace(path, ".")
        return value

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k: self(v) for k, v in value.items()}
        return value


def normalise_probe(document: dict, role: str, package_root: Path | str,
                    extra: Iterable[tuple[str | Path, str]] = ()) -> tuple[dict, dict]:
    """(normalised harness document, volatile values moved out of it)."""
    package_root = Path(package_root)
    scrub = Scrubber([(package_root, role), *extra, (TOOLKIT_ROOT / "probes", "probes")])
    doc = dict(document)
    volatile: dict[str, Any] = {}
    if "import_seconds" in doc:
        volatile["import_seconds"] = doc.pop("import_seconds")
    doc["tree"] = role
    sglang_file = doc.get("sglang_file")
    if isinstance(sglang_file, str) and os.path.isabs(sglang_file):
        for root in (str(package_root), os.path.realpath(str(package_root))):
            if os.path.commonpath([sglang_file, root]) == root:
                doc["sglang_file"] = Path(os.path.relpath(sglang_file, root)).as_posix()
                break
    return scrub(doc), volatile


def normalise_document(document: dict | None, replacements: Iterable[tuple[str | Path, str]]) -> dict | None:
    if document is None:
        return None
    return Scrubber([*replacements, (TOOLKIT_ROOT / "probes", "probes")])(document)


# ---- toolkit and environment -------------------------------------------------------------------


def toolkit_info(root: Path = TOOLKIT_ROOT) -> dict:
    """Version and git commit of the toolkit checkout (commit null when it is not a git checkout)."""
    commit = None
    dirty = None
    try:
        import git

        repo = git.Repo(root)
        try:
            if repo.head.is_valid() and Path(repo.working_tree_dir).resolve() == root.resolve():
                commit = repo.head.commit.hexsha
                # Only the code that decides results; bundles written under evidence/ do not count.
                status = repo.git.status("--porcelain", "--untracked-files=no", "--",
                                         "backport", "probes", "patches", "pyproject.toml")
                dirty = bool(status.strip())
        finally:
            repo.close()
    except Exception:  # noqa: BLE001 - not a checkout, or no git: recorded as null
        commit, dirty = None, None
    return {"name": "sglang-backport", "version": __version__, "git_commit": commit, "git_dirty": dirty}


_ENV_SCRIPT = r"""
import json, platform, sys
from importlib import metadata
names = json.loads(sys.argv[1])
packages = {}
for name in names:
    try:
        packages[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        packages[name] = None
print(json.dumps({"python": platform.python_version(), "implementation": platform.python_implementation(),
                  "platform": platform.platform(), "machine": platform.machine(), "packages": packages}))
"""


def interpreter_environment(python: str, packages: Iterable[str] = KEY_PACKAGES) -> dict:
    """Python, platform and package versions of an interpreter, read without importing the packages."""
    try:
        proc = subprocess.run([python, "-c", _ENV_SCRIPT, json.dumps(list(packages))],
                              check=False, capture_output=True, text=True, timeout=120)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"python": None, "implementation": None, "platform": None, "machine": None,
                "packages": {name: None for name in packages}}


def environment_record(probe_env: dict, probe_docs: dict[str, dict]) -> dict:
    """The receipt's environment: the probe interpreter (where SGLang ran) and the toolkit's Python."""
    torch = sorted({d.get("torch") for d in probe_docs.values() if d.get("torch")})
    own = interpreter_environment(sys.executable, TOOLKIT_PACKAGES) if probe_env is not None else {}
    return {
        "python": probe_env.get("python"),
        "implementation": probe_env.get("implementation"),
        "platform": probe_env.get("platform"),
        "machine": probe_env.get("machine"),
        "torch": torch[0] if len(torch) == 1 else (torch or None),
        "packages": probe_env.get("packages", {}),
        "toolkit_python": own.get("python") or platform.python_version(),
        "toolkit_packages": own.get("packages", {}),
    }


# ---- the receipt ---------------------------------------------------------------------------------


@dataclass
class TreeInput:
    """One probed tree as the receipt records it (paths are for normalisation only)."""

    role: str
    spec: str
    version: str
    tree_digest: str
    commit: str | None = None
    artifact_sha256: str | None = None
    unpinned: bool = False
    package_root: Path | None = None
    tree_path: Path | None = None

    def to_input(self) -> dict:
        return {"spec": self.spec, "version": self.version, "tree_digest": self.tree_digest,
                "commit": self.commit, "artifact_sha256": self.artifact_sha256, "unpinned": self.unpinned}


def case_rows(probes: dict[str, dict]) -> list[dict]:
    """One row per (probe, case) across the trees, in harness order; pair and reference check filled in."""
    order: list[tuple[str, str]] = []
    meta: dict[tuple[str, str], dict] = {}
    verdicts: dict[tuple[str, str], dict[str, str]] = {}
    for role in ROLES:
        doc = probes.get(role)
        if doc is None:
            continue
        for case in doc.get("cases", []):
            key = (case["probe"], case["case"])
            if key not in meta:
                order.append(key)
                meta[key] = {"must_preserve": bool(case.get("must_preserve")), "expect": case.get("expect", "")}
            verdicts.setdefault(key, {})[role] = case.get("verdict")
    rows = []
    for key in order:
        seen = verdicts[key]
        row = {
            "probe": key[0],
            "case": key[1],
            "must_preserve": meta[key]["must_preserve"],
            "expect": meta[key]["expect"],
            "verdicts": {role: seen.get(role) for role in ROLES if role in probes},
            "pair": pair_verdict(seen.get(BASE), seen.get(HEAD)),
        }
        row["reference_agrees"] = (seen.get(HEAD) == seen.get(REFERENCE)) if REFERENCE in probes else None
        rows.append(row)
    return rows


def reference_differences(rows: list[dict]) -> list[dict]:
    return [{"probe": r["probe"], "case": r["case"], "patched": r["verdicts"].get(HEAD),
             "reference": r["verdicts"].get(REFERENCE)}
            for r in rows if r["reference_agrees"] is False]


def _upstream_counts(upstream: dict | None) -> dict:
    counts: dict[str, dict[str, int]] = {}
    for tree in (upstream or {}).get("trees") or []:
        per = counts.setdefault(str(tree.get("tree")), {})
        for test in tree.get("tests") or []:
            outcome = str(test.get("outcome"))
            per[outcome] = per.get(outcome, 0) + 1
    return {role: dict(sorted(per.items())) for role, per in sorted(counts.items())}


def summarise(rows: list[dict], probes: dict[str, dict], upstream: dict | None) -> dict:
    pair_counts = {v: 0 for v in PAIR_VERDICTS}
    for row in rows:
        pair_counts[row["pair"]] = pair_counts.get(row["pair"], 0) + 1
    per_tree = {}
    for role, doc in probes.items():
        counts = {v: 0 for v in TREE_VERDICTS}
        for case in doc.get("cases", []):
            counts[case.get("verdict")] = counts.get(case.get("verdict"), 0) + 1
        per_tree[role] = counts
    findings = [{"probe": r["probe"], "case": r["case"], "pair": r["pair"], "must_preserve": r["must_preserve"]}
                for r in rows if is_finding(r["pair"], r["must_preserve"])]
    return {
        "cases": len(rows),
        "must_preserve_cases": sum(1 for r in rows if r["must_preserve"]),
        "pair_verdicts": pair_counts,
        "per_tree": per_tree,
        "findings": findings,
        "reference_differences": sum(1 for r in rows if r["reference_agrees"] is False),
        "upstream_tests": _upstream_counts(upstream),
        "result": "fail" if findings or not rows else "pass",
    }


def build_statement(*, mode: str, target: dict, trees: dict[str, TreeInput], probes: dict[str, dict],
                    probe_files: dict[str, str], apply_report: dict | None, patches: list[dict],
                    series_files: list[dict], upstream_tests: dict, environment: dict, toolkit: dict,
                    subject: dict[str, str], timestamps: dict, reference_choice: str | None = None) -> dict:
    rows = case_rows(probes)
    reference = trees.get(REFERENCE)
    predicate = {
        "schema_version": SCHEMA_VERSION,
        "mode": mode,
        "toolkit": toolkit,
        "environment": environment,
        "inputs": {
            "target": target,
            "series": series_files,
            "patches": patches,
            "trees": {role: trees[role].to_input() for role in ROLES if role in trees},
            "reference": None if reference is None else {**reference.to_input(), "chosen": reference_choice},
        },
        "apply": apply_report,
        "probes": {role: {**probes[role], "file": f"probes/{role}.json", "sha256": probe_files[role]}
                   for role in ROLES if role in probes},
        "cases": rows,
        "reference_differences": reference_differences(rows),
        "upstream_tests": {**upstream_tests, "file": UPSTREAM_TESTS, "sha256": subject[UPSTREAM_TESTS]},
        "summary": summarise(rows, probes, upstream_tests),
        "timestamps": timestamps,
    }
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": subject[name]}} for name in sorted(subject)],
        "predicateType": PREDICATE_TYPE,
        "predicate": predicate,
    }


# ---- REPORT.md ------------------------------------------------------------------------------------


def _cell(value: Any) -> str:
    return "-" if value is None else str(value).replace("|", "\\|")


def render_report(statement: dict) -> str:
    p = statement["predicate"]
    target, trees, summary = p["inputs"]["target"], p["inputs"]["trees"], p["summary"]
    roles = [r for r in ROLES if r in p["probes"]]
    lines = [f"# Evidence: {target['spec']}", ""]
    lines.append(f"Result: **{summary['result'].upper()}** ({summary['cases']} cases; "
                 + ", ".join(f"{n} {v}" for v, n in summary["pair_verdicts"].items() if n) + ").")
    lines += ["", (f"Toolkit sglang-backport {p['toolkit']['version']} "
                   f"(commit {p['toolkit']['git_commit'] or 'none: not a git checkout'}). "
                   f"Probe environment: Python {p['environment']['python']}, torch {p['environment']['torch']}, "
                   f"{p['environment']['platform']}."), ""]
    lines += ["## Inputs", "", "| role | spec | version | tree digest (sha256) | commit | artifact sha256 |",
              "|---|---|---|---|---|---|"]
    for role in ROLES:
        if role in trees:
            t = trees[role]
            lines.append(f"| {role} | `{_cell(t['spec'])}` | {_cell(t['version'])} | `{t['tree_digest']}` | "
                         f"`{_cell(t['commit'])}` | `{_cell(t['artifact_sha256'])}` |")
    lines += ["", "## Patches", ""]
    if p["inputs"]["patches"]:
        lines += ["| fix | variant | status | sha256 |", "|---|---|---|---|"]
        for patch in p["inputs"]["patches"]:
            lines.append(f"| {patch['fix']} | `{_cell(patch['path'])}` | {_cell(patch.get('status'))} | "
                         f"`{_cell(patch['sha256'])}` |")
    else:
        lines.append("No patch applied (the head tree is given, not built by the toolkit)."
                     if p["mode"] == "upstream-pair" else "No patch applies to this release.")
    if p["apply"] is not None:
        lines += ["", f"Apply status: {p['apply'].get('status')}; head commit `{p['apply'].get('head_commit')}`."]
    lines += ["", "## Cases", "", ("Pair = pristine -> patched. "
                                   "`*` marks a must-preserve case (behaviour every fix must keep)."), ""]
    header = "| probe / case | " + " | ".join(roles) + " | pair | patched = reference |"
    lines += [header, "|" + "---|" * (len(roles) + 3)]
    for row in p["cases"]:
        name = f"{row['probe']} / {row['case']}{' *' if row['must_preserve'] else ''}"
        agree = {True: "yes", False: "**no**", None: "-"}[row["reference_agrees"]]
        pair = f"**{row['pair']}**" if is_finding(row["pair"], row["must_preserve"]) else row["pair"]
        lines.append(f"| {_cell(name)} | " + " | ".join(_cell(row["verdicts"].get(r)) for r in roles)
                     + f" | {pair} | {agree} |")
    if p["reference_differences"]:
        lines += ["", "Patched differs from the reference in: "
                  + "; ".join(f"{d['probe']}/{d['case']} (patched {d['patched']}, reference {d['reference']})"
                              for d in p["reference_differences"]) + "."]
    lines += ["", "## Upstream tests", ""]
    up = p["upstream_tests"]
    if up.get("skipped"):
        lines.append(f"Skipped: {up['skipped']}")
    else:
        results: dict[tuple, dict[str, str]] = {}
        test_roles: list[str] = []
        for tree in up.get("trees") or []:
            test_roles.append(str(tree.get("tree")))
            for test in tree.get("tests") or []:
                key = (test.get("nodeid") or test.get("file"), test.get("file"), test.get("rev"), test.get("sha256"))
                results.setdefault(key, {})[str(tree.get("tree"))] = str(test.get("outcome"))
        if not results:
            lines.append("No upstream test ran.")
        else:
            lines += ["| test | " + " | ".join(test_roles) + " |", "|" + "---|" * (len(test_roles) + 1)]
            for key in sorted(results, key=lambda k: tuple(str(x) for x in k)):
                lines.append(f"| `{_cell(key[0])}` | " + " | ".join(_cell(results[key].get(r)) for r in test_roles)
                             + " |")
            files = sorted({(k[1], k[2], k[3]) for k in results}, key=lambda k: tuple(str(x) for x in k))
            lines += ["", "Test files: " + "; ".join(f"`{f}` at `{r}` (sha256 `{s}`)" for f, r, s in files) + "."]
    lines += ["", "## Summary", ""]
    lines += [f"- {v}: {n}" for v, n in summary["pair_verdicts"].items()]
    lines.append(f"- must-preserve cases: {summary['must_preserve_cases']}")
    lines.append(f"- patched differs from reference: {summary['reference_differences']}")
    if summary["findings"]:
        lines.append("- findings: " + ", ".join(f"{f['probe']}/{f['case']} ({f['pair']})"
                                               for f in summary["findings"]))
    lines += ["", ("Verdicts: fixed = unsafe on pristine, safe on patched; held = safe on both; "
                   "still-unsafe = unsafe on both; regressed = safe (or absent) on pristine, unsafe on patched; "
                   "added = absent on pristine, safe on patched; error = a tree could not be judged (a finding). "
                   "Check this bundle with `sglang-backport verify <bundle>` or `sha256sum -c SHA256SUMS`."), ""]
    return "\n".join(lines)


# ---- the bundle ----------------------------------------------------------------------------------


@dataclass
class Bundle:
    files: dict[str, bytes]
    statement: dict

    @property
    def summary(self) -> dict:
        return self.statement["predicate"]["summary"]


def assemble(*, mode: str, target: dict, trees: dict[str, TreeInput], probe_docs: dict[str, dict],
             apply_report: dict | None, patches: list[dict], series_files: list[dict],
             upstream_tests: dict | None, environment: dict, toolkit: dict, timestamps: dict,
             reference_choice: str | None = None, extra_paths: Iterable[tuple[str | Path, str]] = ()) -> Bundle:
    """Normalise the raw outputs of a run and lay out every file of its bundle (in memory)."""
    extra_paths = list(extra_paths)
    timestamps = dict(timestamps)
    import_seconds = dict(timestamps.get("import_seconds") or {})
    paths = dict(timestamps.get("paths") or {})
    probes: dict[str, dict] = {}
    tree_paths = []
    for role in ROLES:
        t = trees.get(role)
        if t is not None and t.tree_path is not None and t.package_root != t.tree_path:
            tree_paths.append((t.tree_path, role + "-tree"))
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

    files: dict[str, bytes] = {}
    for role, doc in probes.items():
        files[f"probes/{role}.json"] = canonical_json(doc)
    if apply_doc is not None:
        files[APPLY_REPORT] = canonical_json(apply_doc)
    files[UPSTREAM_TESTS] = canonical_json(upstream)

    def statement_for(report_bytes: bytes | None) -> dict:
        subject = {name: sha256_bytes(data) for name, data in files.items()}
        if report_bytes is not None:
            subject[REPORT] = sha256_bytes(report_bytes)
        else:
            subject[REPORT] = "0" * 64
        return build_statement(
            mode=mode, target=target, trees=trees, probes=probes,
            probe_files={role: subject[f"probes/{role}.json"] for role in probes},
            apply_report=apply_doc, patches=patches, series_files=series_files, upstream_tests=upstream,
            environment=environment, toolkit=toolkit, subject=subject, timestamps=timestamps,
            reference_choice=reference_choice)

    # REPORT.md is rendered from the deterministic part of the statement, then becomes a subject.
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


# ---- verify --------------------------------------------------------------------------------------


@dataclass
class Problem:
    file: str
    kind: str  # modified | missing | unexpected | inconsistent
    detail: str

    def to_json(self) -> dict:
        return {"file": self.file, "kind": self.kind, "detail": self.detail}

    def __str__(self) -> str:
        return f"{self.file}: {self.kind} ({self.detail})"


@dataclass
class VerifyResult:
    bundle: Path
    files: dict[str, str] = field(default_factory=dict)  # name -> sha256 as found
    problems: list[Problem] = field(default_factory=list)
    summary: dict | None = None

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


_SUM_LINE = re.compile(r"([0-9a-f]{64})  ([^\n]+)")


def _parse_sums(data: bytes) -> tuple[dict[str, str] | None, str | None]:
    """(entries, None) for a canonical SHA256SUMS, (None, why) otherwise."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None, "not ASCII text"
    if not text.endswith("\n"):
        return None, "does not end with a newline"
    entries: dict[str, str] = {}
    for number, line in enumerate(text[:-1].split("\n"), 1):
        match = _SUM_LINE.fullmatch(line)
        if not match:
            return None, f"line {number} is not '<sha256>  <name>'"
        name = match.group(2)
        if name in entries or name.startswith("/") or ".." in name.split("/") or "\\" in name:
            return None, f"line {number} names {name!r}, which no bundle file can be"
        entries[name] = match.group(1)
    if sums_text(entries) != text:
        return None, "lines are not in the canonical sorted form"
    return entries, None


def _hex_distance(a: str, b: str) -> int:
    return sum(1 for x, y in zip(a, b) if x != y) + abs(len(a) - len(b))


def _bundle_files(bundle: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(bundle.rglob("*")):
        if path.is_file() or path.is_symlink():
            name = path.relative_to(bundle).as_posix()
            if name != SUMS:
                found[name] = path
    return found


def _schema_errors(statement: dict) -> str | None:
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        schema = json.loads(SCHEMA_PATH.read_text())
    except OSError:
        return None
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(statement), key=lambda e: list(e.absolute_path))
    if not errors:
        return None
    error = errors[0]
    where = "/".join(str(p) for p in error.absolute_path) or "(top)"
    return f"does not match the receipt schema at {where}: {error.message}"


def check_statement(statement: Any) -> list[str]:
    """Internal consistency of a receipt: the structure, the pair verdicts, the summary."""
    problems: list[str] = []
    if not isinstance(statement, dict):
        return ["is not a JSON object"]
    if statement.get("_type") != STATEMENT_TYPE:
        problems.append(f"_type is not {STATEMENT_TYPE}")
    if statement.get("predicateType") != PREDICATE_TYPE:
        problems.append(f"predicateType is not {PREDICATE_TYPE}")
    p = statement.get("predicate")
    if not isinstance(p, dict):
        return problems + ["has no predicate object"]
    for key in ("probes", "cases", "summary", "inputs", "upstream_tests", "reference_differences"):
        if key not in p:
            return problems + [f"predicate has no {key!r}"]
    try:
        probes = dict(p["probes"])
        for role in probes:
            if role not in ROLES:
                problems.append(f"predicate.probes has an unknown role {role!r}")
        expected_rows = case_rows(probes)
        rows = p["cases"]
        if len(rows) != len(expected_rows):
            problems.append(f"cases lists {len(rows)} cases, the per-tree probe results have {len(expected_rows)}")
        for row, expected in zip(rows, expected_rows):
            name = f"{expected['probe']}/{expected['case']}"
            if (row.get("probe"), row.get("case")) != (expected["probe"], expected["case"]):
                problems.append(f"case {row.get('probe')}/{row.get('case')} is not {name} of the probe results")
                break
            if row.get("verdicts") != expected["verdicts"]:
                problems.append(f"case {name}: verdicts {row.get('verdicts')} disagree with the per-tree "
                                f"results {expected['verdicts']}")
            if row.get("pair") != expected["pair"]:
                problems.append(f"case {name}: pair verdict {row.get('pair')!r} does not follow from "
                                f"{expected['verdicts']} (expected {expected['pair']!r})")
            for key in ("must_preserve", "expect", "reference_agrees"):
                if row.get(key) != expected[key]:
                    problems.append(f"case {name}: {key} {row.get(key)!r} disagrees with the probe results")
        if p["reference_differences"] != reference_differences(expected_rows):
            problems.append("reference_differences disagree with the cases")
        expected_summary = summarise(expected_rows, probes, p["upstream_tests"])
        summary = p["summary"]
        for key in sorted(set(expected_summary) | set(summary)):
            if summary.get(key) != expected_summary.get(key):
                problems.append(f"summary.{key} is {summary.get(key)!r}, the cases give {expected_summary.get(key)!r}")
        trees = p["inputs"].get("trees", {})
        if set(trees) != set(probes):
            problems.append(f"inputs.trees names {sorted(trees)}, probes cover {sorted(probes)}")
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        problems.append(f"malformed predicate ({type(exc).__name__}: {exc})")
    return problems


def _strip_embedding(doc: dict, *keys: str) -> dict:
    return {k: v for k, v in doc.items() if k not in keys}


def verify(bundle: Path | str) -> VerifyResult:
    """Recompute every digest of a bundle and re-check its receipt. Problems in a fixed order:
    SHA256SUMS against the files (sorted by name), then the receipt's subjects, then the
    receipt's internal consistency, then the receipt against the files it embeds."""
    bundle = Path(bundle)
    result = VerifyResult(bundle)
    if not bundle.is_dir():
        raise BadInput(f"{bundle}: not a directory")
    present = _bundle_files(bundle)
    actual = {name: sha256_file(path) for name, path in present.items() if path.is_file()}
    for name, path in present.items():
        if path.is_symlink():
            result.problems.append(Problem(name, "unexpected", "a symbolic link; bundles hold regular files only"))
    result.files = dict(actual)
    add = result.problems.append

    sums_path = bundle / SUMS
    if not sums_path.is_file():
        add(Problem(SUMS, "missing", "no SHA256SUMS in the bundle"))
        return result
    listed, why = _parse_sums(sums_path.read_bytes())
    if listed is None:
        add(Problem(SUMS, "modified", why or "unreadable"))
        return result

    statement, subjects = None, None
    try:
        statement = json.loads((bundle / RECEIPT).read_bytes())
        subjects = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    except (OSError, ValueError, KeyError, TypeError):
        statement, subjects = None, None
    subjects = subjects or {}
    receipt_matches_sums = RECEIPT in listed and actual.get(RECEIPT) == listed[RECEIPT]

    # A listed name that no file has, whose digest an unlisted file has: either the file was
    # renamed or the name in SHA256SUMS was altered. The receipt's subjects (and the fixed name
    # receipt.json) say which names a bundle really has.
    known = set(subjects) | {RECEIPT}
    unlisted = {name for name in actual if name not in listed}
    altered = {}
    for name in listed:
        if name not in actual and name not in known:
            renamed = [u for u in sorted(unlisted) if actual[u] == listed[name] and u in known]
            if renamed:
                altered[name] = renamed[0]
    for name in sorted(set(listed) | set(actual)):
        if name in altered:
            add(Problem(SUMS, "modified", f"lists {name!r} where the bundle has {altered[name]!r}"))
        elif name in altered.values():
            continue  # reported as the altered SHA256SUMS entry
        elif name in listed and name not in actual:
            add(Problem(name, "missing", "listed in SHA256SUMS, not in the bundle"))
        elif name not in listed:
            add(Problem(name, "unexpected", "in the bundle, not listed in SHA256SUMS"))
        elif actual[name] != listed[name]:
            if (name != RECEIPT and receipt_matches_sums and subjects.get(name) == actual[name]) \
                    or _hex_distance(actual[name], listed[name]) <= 2:
                add(Problem(SUMS, "modified", f"its digest for {name} was altered; the file itself matches "
                            f"{'the receipt' if subjects.get(name) == actual[name] else 'all but a few hex digits'}"))
            else:
                add(Problem(name, "modified", f"sha256 {actual[name]}, SHA256SUMS says {listed[name]}"))
    if result.problems:
        return result

    if statement is None:
        add(Problem(RECEIPT, "inconsistent", "not an in-toto statement with a subject list"))
        return result
    expected_subjects = set(actual) - {RECEIPT}
    for name in sorted(expected_subjects | set(subjects)):
        if name not in subjects:
            add(Problem(name, "unexpected", "not a subject of the receipt"))
        elif name not in actual:
            add(Problem(name, "missing", "a subject of the receipt, not in the bundle"))
        elif subjects[name] != actual[name]:
            add(Problem(name, "modified", f"sha256 {actual[name]}, the receipt's subject says {subjects[name]}"))
    if result.problems:
        return result

    schema_error = _schema_errors(statement)
    if schema_error:
        add(Problem(RECEIPT, "inconsistent", schema_error))
    for message in check_statement(statement):
        add(Problem(RECEIPT, "inconsistent", message))
    if result.problems:
        return result

    # The receipt embeds what the files hold: they must agree (a consistent rewrite of both is a
    # forgery that only a signature over the receipt can catch).
    p = statement["predicate"]
    for name in sorted(actual):
        try:
            if name.startswith("probes/") and name.endswith(".json"):
                role = name[len("probes/"):-len(".json")]
                embedded = p["probes"].get(role)
                if embedded is None or json.loads((bundle / name).read_bytes()) != \
                        _strip_embedding(embedded, "file", "sha256"):
                    add(Problem(name, "inconsistent", f"differs from predicate.probes.{role} of the receipt"))
            elif name == APPLY_REPORT:
                if json.loads((bundle / name).read_bytes()) != p.get("apply"):
                    add(Problem(name, "inconsistent", "differs from predicate.apply of the receipt"))
            elif name == UPSTREAM_TESTS and json.loads((bundle / name).read_bytes()) != \
                    _strip_embedding(p["upstream_tests"], "file", "sha256"):
                add(Problem(name, "inconsistent", "differs from predicate.upstream_tests of the receipt"))
        except ValueError as exc:
            add(Problem(name, "inconsistent", f"not JSON ({exc})"))
    if APPLY_REPORT not in actual and p.get("apply") is not None:
        add(Problem(APPLY_REPORT, "missing", "the receipt records an apply report"))
    for role in p["probes"]:
        if f"probes/{role}.json" not in actual:
            add(Problem(f"probes/{role}.json", "missing", "the receipt records probe results for it"))
    if not result.problems:
        result.summary = p["summary"]
    return result
