"""Running upstream test files with pytest, one process per file and tree.

Each file runs in the probe interpreter, copied into a temporary directory, with the tree
as the only SGLang on the path (as upstream's CI runs one process per file). Outcomes come
from pytest's JUnit XML (`junit`). Asked to, pytest runs under coverage.py (`coverage run
-m pytest`, then `coverage json`, both the interpreter's own coverage) over the given files
of the tree, and the tree's entry records the lines that ran (`coverage`), or why none were
recorded (`coverage_unavailable`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import tempfile
from pathlib import Path, PurePosixPath

from backport.engine.detect import fingerprint_match, fs_reader
from backport.errors import BadInput
from backport.probing.harness import probe_environ
from backport.upstream.classify import scrub
from backport.upstream.fetch import Fetched, fetch_refs, package_roots
from backport.upstream.junit import entry, parse_junit
from backport.upstream.names import TreeNames
from backport.upstream.refs import TestRef
from backport.vocab import TestOutcome

PYTEST_TIMEOUT = 1800.0          # seconds for one file on one tree
# pytest's last line counts unittest subTest()s apart from tests ("8 passed, 12 subtests passed");
# JUnit XML has one testcase per test, so the counts are read from the summary line.
_SUBTESTS_RE = re.compile(r"(\d+) subtests? (passed|failed|skipped|xfailed|xpassed)")

log = logging.getLogger("backport.upstream")


def has_coverage(python: str) -> bool:
    """Whether the interpreter can run `coverage` (an operator's own may lack it)."""
    try:
        proc = subprocess.run([python, "-c", "import coverage"], capture_output=True, check=False, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _executed_lines(python: str, work: Path, env: dict, package_root: Path, include: list[str],
                    timeout: float) -> dict[str, list[int]] | None:
    """Per measured file (relative to the package root), the lines the run executed (None: no data)."""
    report = work / "coverage.json"
    proc = subprocess.run(
        [
            python,
            "-m",
            "coverage",
            "json",
            f"--data-file={work / '.coverage'}",
            "-o",
            str(report),
            f"--include={','.join(include)}",
            "--rcfile=" + str(work / "empty.coveragerc"),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    if proc.returncode != 0 or not report.is_file():
        return None  # nothing measured (e.g. no measured file was imported): `coverage json` says so
    executed: dict[str, list[int]] = {}
    for name, data in json.loads(report.read_text()).get("files", {}).items():
        path = Path(os.path.realpath(work / name))
        if path.is_relative_to(package_root):
            executed[path.relative_to(package_root).as_posix()] = sorted(data.get("executed_lines", []))
    return executed


def subtest_counts(output: str) -> dict[str, int]:
    """{"passed": 12, ...} from pytest's summary line ({} when the file has no subtests)."""
    lines = [line for line in output.splitlines() if " in " in line and re.search(r"\d+ \w+", line)]
    counts: dict[str, int] = {}
    for number, outcome in _SUBTESTS_RE.findall(lines[-1] if lines else ""):
        counts[outcome] = counts.get(outcome, 0) + int(number)
    return counts


def file_key(ref: TestRef) -> str:
    return f"{ref.path}@{ref.rev}"


def run_file(python: str, package_root: Path, fetched: Fetched, *, names: TreeNames | None = None,
             timeout: float = PYTEST_TIMEOUT, coverage: list[str] | None = None,
             executed: dict[str, set[int]] | None = None, subtests: dict[str, dict] | None = None,
             has_fix: bool | None = None) -> list[dict]:
    """Run one fetched test file with pytest against one tree; per-test entries.

    With `coverage` (files relative to the package root), pytest runs under coverage.py and the
    lines of those files that ran are added to `executed`.
    """
    assert fetched.data is not None
    package_root = Path(package_root).resolve()
    names = names or TreeNames(package_root)
    with tempfile.TemporaryDirectory(prefix="sglang-backport-upstream-") as tmp:
        work = Path(tmp)
        test_file = work / PurePosixPath(fetched.ref.path).name
        test_file.write_bytes(fetched.data)
        # An ini file here stops pytest from picking up configuration above the temp dir.
        (work / "pytest.ini").write_text("[pytest]\n")
        path_dir = work / "path"
        path_dir.mkdir()
        junit = work / "junit.xml"
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={junit}",
               "--rootdir", str(work), test_file.name]
        include = [str(package_root / rel) for rel in coverage or []]
        if include:
            # An empty rc file: no configuration of the caller's (or the tree's) reaches the measurement.
            (work / "empty.coveragerc").write_text("")
            cmd[1:3] = [
                "-m",
                "coverage",
                "run",
                f"--data-file={work / '.coverage'}",
                f"--rcfile={work / 'empty.coveragerc'}",
                f"--include={','.join(include)}",
                "-m",
                "pytest",
            ]
        env = probe_environ(python, package_root, path_dir)
        try:
            proc = subprocess.run(cmd, check=False, cwd=work, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            if include and executed is not None:
                for rel, lines in (
                    _executed_lines(python, work, env, package_root, include, timeout) or {}
                ).items():
                    executed.setdefault(rel, set()).update(lines)
        except subprocess.TimeoutExpired:
            return [entry(fetched, fetched.ref.path, TestOutcome.ERROR,
                          f"pytest did not finish within {timeout:.0f} s on this tree")]
        except OSError as exc:
            raise BadInput(f"{python}: cannot run pytest ({exc.strerror})") from None
        if not junit.is_file():
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
            if "No module named pytest" in proc.stderr:
                raise BadInput(f"{python}: pytest is not installed in the probe interpreter")
            return [entry(fetched, fetched.ref.path, TestOutcome.ERROR,
                          scrub(f"pytest exited {proc.returncode} without a JUnit report: {tail[0]}", tmp))]
        counted = subtest_counts(proc.stdout)
        if counted and subtests is not None:
            subtests[file_key(fetched.ref)] = counted
        results = parse_junit(junit, fetched, names=names, fix_names=fetched.ref.fix_names, tmp=tmp,
                              has_fix=has_fix)
        if not results:
            return [entry(fetched, fetched.ref.path, TestOutcome.ERROR,
                          f"no tests collected (pytest exit {proc.returncode})")]
        return results


def tree_has_fix(package_root: Path, ref: TestRef) -> bool | None:
    """Whether the tree has the fix the file is listed for, by its fingerprint (None: not known)."""
    if ref.fix_record is None or not ref.fix_record.fingerprint:
        return None
    return fingerprint_match(ref.fix_record, fs_reader(package_root))[0]


def run_upstream_tests(trees: list[tuple[str, Path]], refs: list[TestRef], *, python: str,
                       base_url: str | None = None, timeout: float = PYTEST_TIMEOUT,
                       cache_dir: Path | None = None, fetched: list[Fetched] | None = None,
                       coverage: dict[str, list[str]] | None = None) -> dict:
    """Run every ref on every tree. Returns {"trees": [...], "skipped": None | reason, "files": [...]}.

    `trees` are (label, package root) pairs. Each file runs on its own: a file that was not
    fetched (404, the base URL unreachable) is one `unavailable` entry per tree, a file whose
    bytes were refused (not matching its pin, changed at a fixed revision, not Python) one
    `refused` entry, with the reason; the other files still run. When no file at all could be
    obtained, nothing runs and `skipped` carries the reason (each file's is in `files`). A
    tree's `subtests` counts pytest's subtests per file (`path@rev`). `fetched` reuses
    the result of `fetch_refs` for the same refs. `coverage` maps a tree's label to files
    (relative to its package root) to measure while its tests run: that tree's entry gets
    `coverage` ({file: executed lines}) or `coverage_unavailable` (why not).
    """
    roots = package_roots(trees)
    if fetched is None:
        fetched = fetch_refs(roots, refs, base_url=base_url, cache_dir=cache_dir)
    files = [f.to_json() for f in fetched]
    if not fetched:
        return {"trees": [], "skipped": "no upstream test files listed for the selected fixes",
                "files": files}
    for item in fetched:
        if item.error or item.refused:
            log.warning("upstream-tests: %s", item.error or item.refused)
    if all(item.unavailable for item in fetched):
        reason = fetched[0].unavailable
        log.warning("upstream-tests: skipped: %s; no upstream test file was cached", reason)
        return {"trees": [], "skipped": reason, "files": files}
    results = []
    measurable = None
    for label, root in roots:
        names = TreeNames(root)
        tests: list[dict] = []
        measure = (coverage or {}).get(label)
        if measure and measurable is None:
            measurable = has_coverage(python)
        executed: dict[str, set[int]] = {}
        subtests: dict[str, dict] = {}
        for item in fetched:
            if item.error:
                tests.append(entry(item, item.ref.path, TestOutcome.ERROR, item.error))
            elif item.refused:
                tests.append(entry(item, item.ref.path, TestOutcome.REFUSED, item.refused))
            elif item.unavailable:
                tests.append(entry(item, item.ref.path, TestOutcome.UNAVAILABLE,
                                   f"not fetched: {item.unavailable}"))
            else:
                log.info("upstream-tests: %s@%s on %s ...", item.ref.path, item.ref.rev[:12], label)
                try:
                    tests.extend(run_file(python, root, item, names=names, timeout=timeout,
                                          coverage=measure if measurable else None, executed=executed,
                                          subtests=subtests, has_fix=tree_has_fix(root, item.ref)))
                except (OSError, subprocess.SubprocessError) as exc:  # this file's outcome, not the run's
                    tests.append(entry(item, item.ref.path, TestOutcome.ERROR,
                                       f"could not run pytest: {exc}"))
        result: dict = {"tree": label, "tests": tests}
        if subtests:
            result["subtests"] = subtests
        if measure:
            ran = any(item.data is not None for item in fetched)
            if not measurable:
                result["coverage_unavailable"] = "the probe interpreter has no coverage package"
            elif not ran:
                result["coverage_unavailable"] = "no upstream test file was obtained"
            else:
                result["coverage"] = {rel: sorted(lines) for rel, lines in sorted(executed.items())}
        results.append(result)
    return {"trees": results, "skipped": None, "files": files}
