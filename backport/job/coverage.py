"""Which of the lines each patch adds a probe case or an upstream test executed, and which lines
of the pristine functions a fix changes the unsafe cases executed.

The lines a patch adds are found in the patched tree itself: `git blame` attributes every line
of a touched file to the commit that last changed it, and each applied patch is one commit, so
a line blamed on patch P's commit is a line P added (and no later patch rewrote). Executable
lines and executed lines come from coverage.py in the probe interpreter (the harness's
`--coverage`), measured from before `import sglang` to the last case, and, when upstream's
tests ran on the patched tree, from coverage.py around their pytest runs. Lines the pack's
reviewed exclusion list names (`patches/coverage-exclusions.toml`: per fix and variant, a run of
added lines and the reason no probe case runs it), or a fix's `coverage_exclude` pattern in
fixes.toml, are listed apart with their reason and never counted as executed. A line is
`not_executed` when neither a probe case nor an upstream test ran it.

The pristine side: the functions of the pristine tree that hold a line a fix's hunks remove or
insert into (found in the tree the patch applied to, by `ast`, then by name in the pristine
file), and which of their executable lines the cases that are `unsafe` on the pristine tree ran
(the harness records each case's lines as a coverage.py context).

What this proves and what it does not: an executed line ran at least once under some case or
test; it says nothing about whether a case checked what that line does. A line not executed is
code no verdict rests on.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from unidiff import PatchSet

from backport import gitops
from backport.engine.report import ApplyReport, PatchResult
from backport.errors import BadInput
from backport.evidence.coverage import PatchCoverage, totals
from backport.gitops import blame_commits
from backport.pack import Pack
from backport.records import TreeProbe
from backport.vocab import PatchStatus, TreeVerdict

EXCLUSIONS = "coverage-exclusions.toml"


@dataclass(frozen=True)
class Exclusion:
    """A run of consecutive lines that `variants` of `fix` add to `file` (compared with surrounding
    whitespace stripped), excluded from the coverage promise for `reason`; `after`: the lines just
    before the run (in order), where the run alone is not unique."""

    fix: str
    variants: tuple[str, ...]
    file: str
    lines: tuple[str, ...]
    reason: str
    after: tuple[str, ...] = ()


def load_exclusions(pack_root: Path | None) -> list[Exclusion]:
    """The pack's reviewed exclusion list (none when the pack has no such file)."""
    path = Path(pack_root) / EXCLUSIONS if pack_root is not None else None
    if path is None or not path.is_file():
        return []
    try:
        entries = tomllib.loads(path.read_text()).get("exclude", [])
    except tomllib.TOMLDecodeError as err:
        raise BadInput(f"{path}: {err}") from None
    found = []
    for i, e in enumerate(entries, 1):
        where = f"{path} entry {i}"
        if (
            not {"fix", "variants", "file", "lines", "reason"}
            <= set(e)
            <= {"fix", "variants", "file", "lines", "reason", "after"}
        ):
            raise BadInput(
                f"{where}: an entry is {{ fix, variants, file, lines, reason[, after] }}, got {sorted(e)}"
            )
        texts = [e["fix"], e["file"], e["reason"], *e["variants"], *e["lines"]]
        if not e["variants"] or not e["lines"] or not all(isinstance(t, str) and t.strip() for t in texts):
            raise BadInput(f"{where}: fix, file, reason, every variant and every line must be non-empty text")
        after = e.get("after", [])
        after = [after] if isinstance(after, str) else after
        if not isinstance(after, list) or not all(isinstance(t, str) for t in after):
            raise BadInput(f"{where}: after must be the text of the line (or lines) before the run")
        found.append(
            Exclusion(
                e["fix"],
                tuple(e["variants"]),
                e["file"],
                tuple(t.strip() for t in e["lines"]),
                e["reason"].strip(),
                tuple(t.strip() for t in after),
            )
        )
    return found


def _runs(texts: list[str], run: tuple[str, ...], after: tuple[str, ...] = (), added: list[bool] | None = None
          ) -> list[int]:
    """Where `run` starts in `texts` (0-based), comparing stripped lines; only where the lines before
    it are `after`, and with `added`, only where every line of the run is an added one."""
    stripped = [t.strip() for t in texts]
    return [i for i in range(len(after), len(stripped) - len(run) + 1)
            if tuple(stripped[i:i + len(run)]) == run and tuple(stripped[i - len(after):i]) == after
            and (added is None or all(added[i:i + len(run)]))]


def times_added(variant, e: Exclusion) -> int:
    """How often `variant` adds the entry's run of lines to its file (consecutive added lines)."""
    hits = 0
    for fp in variant.files:
        if fp.path == e.file:
            for hunk in fp.hunks:
                new = [(tag, text) for tag, text in hunk.lines if tag != "-"]
                hits += len(_runs([t for _, t in new], e.lines, e.after, [tag == "+" for tag, _ in new]))
    return hits


def stale_exclusions(pack) -> list[str]:
    """Entries that no longer match: a listed variant the pack lacks, or one that does not add the
    entry's run of lines to its file exactly once."""
    found = []
    for e in load_exclusions(getattr(pack, "root", None)):
        variants = {v.name: v for v in pack.variants.get(e.fix, ())}
        for name in e.variants:
            if name not in variants:
                found.append(f"{e.fix} {name}: no such variant ({e.file}: {e.lines[0]!r})")
            elif (hits := times_added(variants[name], e)) != 1:
                found.append(
                    f"{e.fix} {name}: adds the run starting {e.lines[0]!r} to {e.file} {hits} times, not once"
                )
    return found


def _excluded(exclusions: list[Exclusion], patch: PatchResult, rel: str, commits: list[str], lines: list[str]
              ) -> dict[int, str]:
    """Line number -> reason, for the runs of this patch's own lines in `rel` that an entry names."""
    found: dict[int, str] = {}
    for e in exclusions:
        if e.fix != patch.fix or patch.variant not in e.variants or e.file != rel:
            continue
        for start in _runs(lines, e.lines, e.after):
            numbers = range(start + 1, start + 1 + len(e.lines))
            if all(n <= len(commits) and commits[n - 1] == patch.commit for n in numbers):
                found.update((n, e.reason) for n in numbers)
    return found


def _applied(report: ApplyReport | None) -> list[PatchResult]:
    """The patches the engine applied with a commit of their own (none without a report)."""
    return [p for p in (report.patches if report else ()) if p.status == PatchStatus.APPLIED and p.commit]


def touched_files(report: ApplyReport | None) -> list[str]:
    """Every file (relative to the package root) an applied patch changes."""
    files = {h.file for p in (report.patches if report else ()) if p.status == PatchStatus.APPLIED
             for h in p.hunks}
    return sorted(files)


def upstream_lines(
    upstream_doc: dict | None, tree: str = "patched"
) -> tuple[dict[str, set[int]] | None, str | None]:
    """(the lines upstream's tests ran on `tree`, per file; or None and why they are not known)."""
    if not upstream_doc:
        return None, "upstream tests did not run"
    if upstream_doc.get("skipped"):
        return None, f"upstream tests did not run: {upstream_doc['skipped']}"
    entry = next((t for t in upstream_doc.get("trees") or [] if t.get("tree") == tree), None)
    if entry is None:
        return None, f"upstream tests did not run on the {tree} tree"
    if entry.get("coverage") is None:
        return None, entry.get("coverage_unavailable") or "upstream tests ran without coverage"
    return {rel: set(lines) for rel, lines in entry["coverage"].items()}, None


def patch_coverage(
    tree_path: Path,
    package_prefix: str,
    report: ApplyReport | None,
    pack: Pack,
    probe_doc: dict,
    min_percent: float | None = None,
    *,
    upstream: tuple[dict[str, set[int]] | None, str | None] = (None, "upstream tests did not run"),
) -> tuple[dict, dict[str, list[str]]]:
    """The receipt's `coverage` section for the patched tree, and per fix the added lines
    upstream's tests ran (what `upstream-tests.json` records for the patched tree)."""
    measured = probe_doc.get("coverage")
    if measured is None:
        reason = probe_doc.get("coverage_unavailable") or "the probe run recorded no coverage"
        return (
            {"measured": False, "reason": reason, "patches": [], "totals": {}, "min_percent": min_percent},
            {},
        )
    upstream_ran, upstream_reason = upstream
    listed = load_exclusions(getattr(pack, "root", None))
    blamed: dict[str, tuple[list[str], list[str]]] = {}  # file -> (commit per line, its lines), read once
    patches = []
    by_upstream: dict[str, list[str]] = {}
    for patch in _applied(report):
        fix = pack.fixes.get(patch.fix)
        exclusions = fix.coverage_exclude if fix is not None else ()
        added = executed = 0
        excluded: list[dict[str, str]] = []
        not_executed: list[str] = []
        only_upstream: list[str] = []
        upstream_hits: list[str] = []
        for rel in sorted({h.file for h in patch.hunks}):
            if rel not in blamed:
                blamed[rel] = (
                    blame_commits(tree_path, f"{package_prefix}{rel}"),
                    (tree_path / f"{package_prefix}{rel}").read_text(errors="replace").splitlines(),
                )
            commits, lines = blamed[rel]
            file_cov = measured.get(rel, {"statements": [], "executed": []})
            statements, ran = set(file_cov["statements"]), set(file_cov["executed"])
            ran_upstream = (upstream_ran or {}).get(rel, set())
            reviewed = _excluded(listed, patch, rel, commits, lines)
            for number, commit in enumerate(commits, 1):
                if commit != patch.commit or number not in statements:
                    continue
                text = lines[number - 1] if number <= len(lines) else ""
                reason = reviewed.get(number) or next((x.reason for x in exclusions
                                                       if x.file == rel and re.search(x.pattern, text)), None)
                where = f"{rel}:{number}"
                if reason is not None:
                    excluded.append({"line": where, "reason": reason})
                    continue
                added += 1
                if number in ran_upstream:
                    upstream_hits.append(where)
                if number in ran:
                    executed += 1
                elif number in ran_upstream:
                    only_upstream.append(where)
                else:
                    not_executed.append(where)
        if upstream_ran is not None:
            by_upstream[patch.fix] = upstream_hits
        patches.append(PatchCoverage(
            fix=patch.fix, variant=patch.variant, added=added, executed_by_probes=executed,
            executed_by_upstream_tests=None if upstream_ran is None else len(upstream_hits),
            executed_only_by_upstream_tests=tuple(only_upstream), excluded=tuple(excluded),
            not_executed=tuple(not_executed)))
    section = {"measured": True, "patches": [p.to_json() for p in patches], "totals": totals(patches),
               "min_percent": min_percent,
               "upstream_tests": {"measured": upstream_ran is not None,
                                  "reason": None if upstream_ran is not None else upstream_reason}}
    return section, by_upstream


# ---- the pristine functions a fix changes ----------------------------------------------------------


def _functions(source: str) -> list[tuple[str, int, int, int]]:
    """(qualified name, first line, last line, indentation) of every function in a module."""
    found: list[tuple[str, int, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                found.append((name, first, child.end_lineno or child.lineno, child.col_offset))
                visit(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    try:
        visit(ast.parse(source), "")
    except (SyntaxError, ValueError):
        return []
    return found


def _innermost(functions: list[tuple[str, int, int, int]], line: int, *, insert_indent: int | None = None
               ) -> str | None:
    """The innermost function holding `line`; with `insert_indent`, a line inserted after `line`
    belongs to a function that continues past it, or that it is indented into at its end."""
    best = None
    for name, first, last, indent in functions:
        inside = first <= line <= last if insert_indent is None else (
            first <= line < last or (line == last and insert_indent > indent))
        if inside and (best is None or first >= best[1]):
            best = (name, first)
    return best[0] if best else None


def _inserted_into(functions: list[tuple[str, int, int, int]], after: int, block: list[str]) -> str | None:
    """The function a run of added lines inserted after line `after` goes into, judged by the
    run's first non-blank line (a new function appended after another is not inside it)."""
    first = next((text for text in block if text.strip()), None)
    if first is None:
        return None
    return _innermost(functions, after, insert_indent=len(first) - len(first.lstrip()))


def changed_functions(tree_path: Path, package_prefix: str, commit: str) -> list[tuple[str, str]]:
    """(file, qualified function name) the commit changes, in the tree it applied to: functions
    holding a line it removes or changes, or into which it inserts lines."""
    text = gitops.diff(tree_path, f"{commit}^", commit, package_prefix)
    touched: set[tuple[str, str | None]] = set()
    for patched_file in PatchSet(text):
        rel = patched_file.source_file.removeprefix("a/")
        if patched_file.is_added_file:
            continue
        spec = f"{commit}^:{package_prefix}{rel}"
        functions = _functions((gitops.read_blobs(tree_path, [spec])[spec] or b"").decode("utf-8", "replace"))
        for hunk in patched_file:
            last_source = hunk.source_start - 1
            block: list[str] = []  # the run of added lines being read
            for line in [*hunk, None]:  # None: the hunk's end closes its last run
                if line is not None and line.is_added:
                    block.append(line.value)
                    continue
                if block:
                    touched.add((rel, _inserted_into(functions, last_source, block)))
                    block = []
                if line is not None and line.is_removed:
                    touched.add((rel, _innermost(functions, line.source_line_no)))
                if line is not None and line.source_line_no is not None:
                    last_source = line.source_line_no
    return sorted((rel, name) for rel, name in touched if name)


def pristine_functions(pristine_root: Path, tree_path: Path, package_prefix: str, report: ApplyReport | None,
                       pristine_doc: dict) -> list[dict]:
    """Per fix, each pristine function it changes: its executable lines, how many of them the cases
    unsafe on the pristine tree ran, and which of those cases ran any."""
    measured = pristine_doc.get("coverage")
    unsafe = [
        f"{c['probe']}/{c['case']}" for c in pristine_doc.get("cases", [])
        if c.get("verdict") == TreeVerdict.UNSAFE
    ]
    entries: list[dict] = []
    sources: dict[str, list[tuple[str, int, int, int]]] = {}
    for patch in _applied(report):
        assert patch.commit is not None  # _applied keeps those with a commit
        for rel, name in changed_functions(tree_path, package_prefix, patch.commit):
            path = Path(pristine_root) / rel
            if rel not in sources:
                sources[rel] = _functions(path.read_text(errors="replace")) if path.is_file() else []
            span = next(((first, last) for fn, first, last, _ in sources[rel] if fn == name), None)
            if span is None:
                continue  # a function an earlier patch added: not pristine code
            entry = {
                "fix": patch.fix,
                "file": rel,
                "function": name,
                "first_line": span[0],
                "last_line": span[1],
                "lines": None,
                "executed_by_unsafe_cases": None,
                "unsafe_cases": [],
            }
            file_cov = (measured or {}).get(rel)
            if file_cov is not None and "cases" in file_cov:
                statements = {n for n in file_cov["statements"] if span[0] <= n <= span[1]}
                hits = {case: statements & set(file_cov["cases"].get(case, ())) for case in unsafe}
                entry.update(lines=len(statements), executed_by_unsafe_cases=len(set().union(*hits.values())),
                             unsafe_cases=sorted(case for case, lines in hits.items() if lines))
            entries.append(entry)
    return entries


def pristine_reason(pristine_doc: dict) -> str | None:
    """Why the pristine functions' lines carry no counts (None: they do)."""
    if pristine_doc.get("coverage") is None:
        return pristine_doc.get("coverage_unavailable") or "the pristine probe run recorded no coverage"
    if any("cases" not in f for f in pristine_doc["coverage"].values()):
        return "the pristine probe run recorded no per-case coverage"
    return None


def measure(trees: dict, report: ApplyReport | None, pack: Pack, probes: dict[str, TreeProbe],
            min_percent: float | None, upstream_doc: dict | None) -> tuple[dict | None, dict[str, TreeProbe]]:
    """The run's coverage section (None: nothing was applied), and the probe results without their raw
    per-file line lists (every tree's document would carry thousands of line numbers the section
    summarises). Upstream's record for the patched tree becomes, per fix, the added lines its tests ran
    (`added_lines_executed`), which `verify` checks the section against."""
    section = None
    if report is not None and "patched" in probes:
        patched = trees["patched"]
        prefix = str(patched.package_root.relative_to(patched.tree_path)).strip(".")
        prefix = f"{prefix}/" if prefix else ""
        section, by_upstream = patch_coverage(
            patched.tree_path,
            prefix,
            report,
            pack,
            probes["patched"].to_json(),
            min_percent,
            upstream=upstream_lines(upstream_doc),
        )
        if section["measured"] and "pristine" in probes:
            pristine = probes["pristine"].to_json()
            section["pristine_functions"] = pristine_functions(
                trees["pristine"].package_root, patched.tree_path, prefix, report, pristine
            )
            section["pristine_reason"] = pristine_reason(pristine)
        for entry in (upstream_doc or {}).get("trees") or []:
            if (
                entry.get("tree") == "patched"
                and section["measured"]
                and section["upstream_tests"]["measured"]
            ):
                entry["added_lines_executed"] = by_upstream
    for entry in (upstream_doc or {}).get("trees") or []:
        entry.pop("coverage", None)
    stripped = {role: dataclasses.replace(probe, coverage=None, coverage_unavailable=None)
                for role, probe in probes.items()}
    return section, stripped
