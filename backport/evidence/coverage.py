"""The receipt's coverage section: which lines each patch adds ran under a probe case or an
upstream test, and which lines of the pristine functions a fix changes the unsafe cases ran.

The section is measured by the job (`backport/job/coverage.py`); here it is summarised, checked
(its totals must follow from its per-patch entries, its upstream counts from what
`upstream-tests.json` records, its pristine functions' cases from the pristine probe results)
and rendered for REPORT.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backport.vocab import TreeVerdict


@dataclass(frozen=True)
class PatchCoverage:
    """One applied patch's added lines (the section's `patches[]`): how many are executable and not
    excluded, how many ran under a probe case, under upstream's tests (None: they did not run) or only
    under them, the excluded ones with their reasons, the ones nothing ran (`file:line`)."""

    fix: str
    variant: str | None
    added: int
    executed_by_probes: int
    executed_by_upstream_tests: int | None
    executed_only_by_upstream_tests: tuple[str, ...]
    excluded: tuple[dict[str, str], ...]  # {"line": "file:N", "reason": ...}
    not_executed: tuple[str, ...]

    def to_json(self) -> dict:
        return {"fix": self.fix, "variant": self.variant, "added": self.added,
                "executed_by_probes": self.executed_by_probes,
                "executed_by_upstream_tests": self.executed_by_upstream_tests,
                "executed_only_by_upstream_tests": list(self.executed_only_by_upstream_tests),
                "excluded": [dict(x) for x in self.excluded], "not_executed": list(self.not_executed)}

    @classmethod
    def from_json(cls, doc: dict) -> PatchCoverage:
        """An entry of a receipt read back (before upstream coverage an entry had no upstream keys)."""
        return cls(fix=doc["fix"], variant=doc.get("variant"), added=doc["added"],
                   executed_by_probes=doc["executed_by_probes"],
                   executed_by_upstream_tests=doc.get("executed_by_upstream_tests"),
                   executed_only_by_upstream_tests=tuple(doc.get("executed_only_by_upstream_tests") or ()),
                   excluded=tuple(doc["excluded"]), not_executed=tuple(doc["not_executed"]))


def totals(patches: Sequence[PatchCoverage]) -> dict[str, int | float | None]:
    added = sum(p.added for p in patches)
    executed = sum(p.executed_by_probes for p in patches)
    upstream = [p.executed_by_upstream_tests for p in patches]
    return {"added": added, "executed_by_probes": executed,
            "executed_by_upstream_tests": None if not patches or None in upstream else sum(
                n for n in upstream if n is not None),
            "executed_only_by_upstream_tests": sum(len(p.executed_only_by_upstream_tests) for p in patches),
            "excluded": sum(len(p.excluded) for p in patches),
            "not_executed": sum(len(p.not_executed) for p in patches),
            "percent": round(100.0 * executed / added, 1) if added else 100.0}


def entries(coverage: dict) -> list[PatchCoverage]:
    """The section's per-patch entries, read back."""
    return [PatchCoverage.from_json(p) for p in coverage["patches"]]


def summary(coverage: dict | None) -> dict | None:
    """What `summary.coverage` says: the totals and the floor the run was held to (None: not measured)."""
    if not coverage or not coverage.get("measured"):
        return None
    return {**totals(entries(coverage)), "min_percent": coverage.get("min_percent")}


def below_floor(coverage: dict | None) -> bool:
    """True when a floor was set and the patches' lines executed by probes fall short of it, or
    coverage could not be measured at all (a floor nobody could check is not met)."""
    if not coverage or coverage.get("min_percent") is None:
        return False
    s = summary(coverage)
    return s is None or s["percent"] < s["min_percent"]


def _upstream_record(upstream: dict | None) -> dict[str, list[str]] | None:
    """Per fix, the added lines upstream-tests.json says the tests ran on the patched tree."""
    entry = next((t for t in (upstream or {}).get("trees") or [] if t.get("tree") == "patched"), None)
    return None if entry is None else entry.get("added_lines_executed")


def _patch_problems(entry: dict, record: dict[str, list[str]] | None) -> list[str]:
    fix, found = entry["fix"], []
    only = entry.get("executed_only_by_upstream_tests") or []
    by_upstream = entry.get("executed_by_upstream_tests")
    if entry["executed_by_probes"] + len(only) + len(entry["not_executed"]) != entry["added"]:
        found.append(
            f"coverage of {fix}: executed by probes {entry['executed_by_probes']} + only by upstream "
            f"tests {len(only)} + not executed {len(entry['not_executed'])} is not the "
            f"{entry['added']} added lines"
        )
    if by_upstream is None:
        if only:
            found.append(f"coverage of {fix}: lines executed only by upstream tests, but upstream tests are "
                         f"recorded as not measured")
        return found
    if not len(only) <= by_upstream <= entry["added"] - len(entry["not_executed"]):
        found.append(f"coverage of {fix}: {by_upstream} lines executed by upstream tests is impossible with "
                     f"{len(only)} executed only by them and {len(entry['not_executed'])} not executed")
    ran = (record or {}).get(fix)
    if ran is None:
        found.append(f"coverage of {fix}: upstream-tests.json records no added lines the tests ran for it")
        return found
    if len(ran) != by_upstream:
        found.append(f"coverage of {fix}: executed_by_upstream_tests is {by_upstream}, upstream-tests.json "
                     f"lists {len(ran)} added lines the tests ran")
    if not set(only) <= set(ran):
        found.append(f"coverage of {fix}: {min(set(only) - set(ran))} is listed as executed only by "
                     f"upstream tests, which upstream-tests.json does not say ran")
    if set(entry["not_executed"]) & set(ran):
        found.append(f"coverage of {fix}: {min(set(entry['not_executed']) & set(ran))} is listed as not "
                     f"executed, but upstream-tests.json says the tests ran it")
    return found


def _pristine_problems(coverage: dict, pristine: dict | None, fixes: set[str]) -> list[str]:
    unsafe = {
        f"{c['probe']}/{c['case']}" for c in (pristine or {}).get("cases", [])
        if c.get("verdict") == TreeVerdict.UNSAFE
    }
    found = []
    for f in coverage.get("pristine_functions") or []:
        name = f"pristine function {f['file']}:{f['function']} ({f['fix']})"
        if f["fix"] not in fixes:
            found.append(f"{name}: {f['fix']} is not an applied patch of the coverage section")
        if f["first_line"] > f["last_line"]:
            found.append(f"{name}: first line {f['first_line']} is after last line {f['last_line']}")
        if f["lines"] is None:
            if f["executed_by_unsafe_cases"] is not None or f["unsafe_cases"]:
                found.append(f"{name}: executed lines without measured lines")
            continue
        if f["executed_by_unsafe_cases"] is None or not 0 <= f["executed_by_unsafe_cases"] <= f["lines"]:
            found.append(
                f"{name}: {f['executed_by_unsafe_cases']} executed of {f['lines']} lines is impossible"
            )
        elif (f["executed_by_unsafe_cases"] == 0) != (not f["unsafe_cases"]):
            found.append(f"{name}: {f['executed_by_unsafe_cases']} lines executed by the unsafe cases "
                         f"{f['unsafe_cases']}")
        strangers = sorted(set(f["unsafe_cases"]) - unsafe)
        if strangers:
            found.append(f"{name}: {strangers[0]} is not unsafe on the pristine tree")
    return found


def problems(
    coverage: dict | None, *, upstream: dict | None = None, pristine: dict | None = None
) -> list[str]:
    """Contradictions inside the section (every number must follow from the per-patch lists), and
    against upstream-tests.json (`upstream`) and the pristine probe results (`pristine`)."""
    if not coverage or not coverage.get("measured"):
        return []
    found = []
    record = _upstream_record(upstream)
    measured = (coverage.get("upstream_tests") or {}).get("measured", False)
    for entry in coverage["patches"]:
        found += _patch_problems(entry, record)
        if (entry.get("executed_by_upstream_tests") is not None) != measured:
            found.append(
                f"coverage of {entry['fix']}: executed_by_upstream_tests is "
                f"{entry.get('executed_by_upstream_tests')!r} but coverage.upstream_tests.measured is "
                f"{measured}"
            )
    if measured and (upstream or {}).get("skipped"):
        found.append(f"coverage.upstream_tests.measured is true, but upstream tests were skipped "
                     f"({(upstream or {})['skipped']})")
    if measured and record is None:
        found.append("coverage.upstream_tests.measured is true, but upstream-tests.json records no lines the "
                     "tests ran on the patched tree")
    if not measured and record is not None:
        found.append("upstream-tests.json records lines the tests ran on the patched tree, but "
                     "coverage.upstream_tests.measured is false")
    if record is not None and set(record) != {e["fix"] for e in coverage["patches"]}:
        found.append(f"upstream-tests.json records ran lines for {sorted(record)}, the coverage section has "
                     f"{sorted(e['fix'] for e in coverage['patches'])}")
    derived = totals(entries(coverage))
    if coverage.get("totals") != derived:
        found.append(f"coverage.totals {coverage.get('totals')} do not follow from the per-patch entries "
                     f"{derived}")
    found += _pristine_problems(coverage, pristine, {e["fix"] for e in coverage["patches"]})
    return found


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def _excluded_ranges(excluded: list[dict]) -> str:
    """Excluded lines as `file:first-last` (reason), one per run of lines in a file with the same reason."""
    groups: list[tuple[str, int, int, str]] = []
    for x in excluded:
        rel, _, number = x["line"].rpartition(":")
        if groups and groups[-1][0] == rel and groups[-1][3] == x["reason"] and number.isdigit():
            groups[-1] = (rel, groups[-1][1], int(number), x["reason"])
        elif number.isdigit():
            groups.append((rel, int(number), int(number), x["reason"]))
        else:
            groups.append((x["line"], -1, -1, x["reason"]))
    return ", ".join(f"`{rel}:{a}{'' if a == b else f'-{b}'}` ({reason})" if a >= 0 else f"`{rel}` ({reason})"
                     for rel, a, b, reason in groups) or "-"


def render(coverage: dict | None) -> list[str]:
    """REPORT.md lines."""
    lines = ["## Coverage of the patches", ""]
    if not coverage or not coverage.get("measured"):
        reason = (coverage or {}).get("reason", "not measured in this run")
        return lines + [f"Not measured: {reason}.", ""]
    t = totals(entries(coverage))
    upstream = coverage.get("upstream_tests") or {"measured": False, "reason": "not recorded"}
    lines += [
        f"{t['executed_by_probes']} of the {t['added']} executable lines the pack adds ran under a probe "
        f"case ({t['percent']}%); {t['excluded']} excluded with a listed reason"
        + (f"; floor {coverage['min_percent']}%" if coverage.get("min_percent") is not None else "")
        + ".",
        (
            f"Upstream's tests ran {t['executed_by_upstream_tests']} of them, "
            f"{t['executed_only_by_upstream_tests']} that no probe case ran; "
            f"{t['not_executed']} ran under neither."
            if upstream["measured"]
            else f"Upstream's tests: not measured ({upstream.get('reason')}); "
            f"{t['not_executed']} lines ran under no probe case."
        ),
        (
            "An executed line ran at least once under some case or test; it does not prove a case checked "
            "it. "
            "A line not executed is code no verdict rests on."
        ),
        "",
        "| fix | variant | added | executed by probes | by upstream tests | excluded | not executed |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in coverage["patches"]:
        by_upstream = (
            "not measured" if p["executed_by_upstream_tests"] is None else p["executed_by_upstream_tests"]
        )
        only = p.get("executed_only_by_upstream_tests") or []
        if only:
            by_upstream = f"{by_upstream} (only by them: {', '.join(f'`{x}`' for x in only)})"
        missing = ", ".join(f"`{x}`" for x in p["not_executed"]) or "-"
        excluded = _excluded_ranges(p["excluded"])
        lines.append(
            f"| {p['fix']} | {p['variant']} | {p['added']} | {p['executed_by_probes']} | {by_upstream} "
            f"| {excluded} | {missing} |"
        )
    functions = coverage.get("pristine_functions")
    if functions is not None:
        lines += ["", "### Pristine functions the fixes change", ""]
        if coverage.get("pristine_reason"):
            lines.append(f"Lines not counted: {coverage['pristine_reason']}.")
        if not functions:
            lines.append("No applied patch changes a function of the pristine tree.")
        else:
            lines += [
                (
                    "Per fix, each function of the pristine tree its hunks change: its executable lines, and "
                    "how many of them the cases unsafe on the pristine tree ran."
                ),
                "",
                "| fix | function | lines | executed by unsafe cases | unsafe cases |",
                "|---|---|---|---|---|",
            ]
            for f in functions:
                cases = ", ".join(f"`{c}`" for c in f["unsafe_cases"]) or "-"
                lines.append(
                    f"| {f['fix']} | `{f['file']}:{f['first_line']}-{f['last_line']}` `{f['function']}` "
                    f"| {_cell(f['lines'])} | {_cell(f['executed_by_unsafe_cases'])} | {cases} |"
                )
    return lines + [""]
