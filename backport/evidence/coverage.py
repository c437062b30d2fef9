"""The receipt's coverage section: which lines each patch adds ran under a probe case.

The section is measured by the job (`backport/job/coverage.py`); here it is summarised, checked
(its totals must follow from its per-patch entries) and rendered for REPORT.md.
"""

from __future__ import annotations


def totals(patches: list[dict]) -> dict:
    added = sum(p["added"] for p in patches)
    executed = sum(p["executed_by_probes"] for p in patches)
    return {"added": added, "executed_by_probes": executed,
            "excluded": sum(len(p["excluded"]) for p in patches),
            "not_executed": sum(len(p["not_executed"]) for p in patches),
            "percent": round(100.0 * executed / added, 1) if added else 100.0}


def summary(coverage: dict | None) -> dict | None:
    """What `summary.coverage` says: the totals and the floor the run was held to (None: not measured)."""
    if not coverage or not coverage.get("measured"):
        return None
    return {**totals(coverage["patches"]), "min_percent": coverage.get("min_percent")}


def below_floor(coverage: dict | None) -> bool:
    """True when a floor was set and the patches' executed lines fall short of it, or coverage
    could not be measured at all (a floor nobody could check is not met)."""
    if not coverage or coverage.get("min_percent") is None:
        return False
    s = summary(coverage)
    return s is None or s["percent"] < s["min_percent"]


def problems(coverage: dict | None) -> list[str]:
    """Contradictions inside the section (every number must follow from the per-patch lists)."""
    if not coverage or not coverage.get("measured"):
        return []
    found = []
    for entry in coverage["patches"]:
        if entry["executed_by_probes"] + len(entry["not_executed"]) != entry["added"]:
            found.append(f"coverage of {entry['fix']}: executed {entry['executed_by_probes']} + not executed "
                         f"{len(entry['not_executed'])} is not the {entry['added']} added lines")
    if coverage.get("totals") != totals(coverage["patches"]):
        found.append(f"coverage.totals {coverage.get('totals')} do not follow from the per-patch entries "
                     f"{totals(coverage['patches'])}")
    return found


def render(coverage: dict | None) -> list[str]:
    """REPORT.md lines."""
    lines = ["## Coverage of the patches", ""]
    if not coverage or not coverage.get("measured"):
        reason = (coverage or {}).get("reason", "not measured in this run")
        return lines + [f"Not measured: {reason}.", ""]
    t = totals(coverage["patches"])
    lines += [f"{t['executed_by_probes']} of the {t['added']} executable lines the pack adds ran under a probe "
              f"case ({t['percent']}%); {t['excluded']} excluded with a listed reason"
              + (f"; floor {coverage['min_percent']}%" if coverage.get("min_percent") is not None else "") + ".",
              ("An executed line ran at least once under some case; it does not prove a case checked it. "
              "A line not executed is code no verdict rests on."), "",
              "| fix | variant | added | executed by probes | by upstream tests | excluded | not executed |",
              "|---|---|---|---|---|---|---|"]
    for p in coverage["patches"]:
        upstream = "not measured" if p["executed_by_upstream_tests"] is None else p["executed_by_upstream_tests"]
        missing = ", ".join(f"`{x}`" for x in p["not_executed"]) or "-"
        excluded = ", ".join(f"`{x['line']}` ({x['reason']})" for x in p["excluded"]) or "-"
        lines.append(f"| {p['fix']} | {p['variant']} | {p['added']} | {p['executed_by_probes']} | {upstream} "
                     f"| {excluded} | {missing} |")
    return lines + [""]
