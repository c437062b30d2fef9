"""REPORT.md: the receipt rendered for a human reader.

The report is a pure function of the receipt (timestamps aside), so `verify` can render the
receipt again and compare byte for byte.
"""

from __future__ import annotations

from typing import Any

from backport.evidence import artifacts, coverage, live
from backport.evidence.verdicts import PAIR_VERDICTS, ROLES, is_finding


def _cell(value: Any) -> str:
    return "-" if value is None else str(value).replace("|", "\\|")


def _pair_counts(summary: dict) -> list[tuple[str, int]]:
    """The pair verdict counts in the table's order (a receipt read back has its keys sorted)."""
    counts = summary["pair_verdicts"]
    order = [v for v in PAIR_VERDICTS if v in counts] + sorted(v for v in counts if v not in PAIR_VERDICTS)
    return [(v, counts[v]) for v in order]


def render_report(statement: dict) -> str:
    p = statement["predicate"]
    target, trees, summary = p["inputs"]["target"], p["inputs"]["trees"], p["summary"]
    roles = [r for r in ROLES if r in p["probes"]]
    lines = [f"# Evidence: {target['spec']}", ""]
    lines.append(f"Result: **{summary['result'].upper()}** ({summary['cases']} cases; "
                 + ", ".join(f"{n} {v}" for v, n in _pair_counts(summary) if n) + ").")
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
    lines += [""] + artifacts.render(statement)[:-1]
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
        listed = sorted({(f.get("path"), f.get("rev"), f.get("pin")) for f in up.get("files") or []},
                        key=lambda k: tuple(str(x) for x in k))
        if listed:
            lines += ["", "Test files (not run): " + "; ".join(
                f"`{f}` at `{r}` ({'pinned, sha256 `' + pin + '`' if pin else 'unpinned'})" for f, r, pin in listed)
                + "."]
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
            pins = {(f.get("path"), f.get("rev")): f.get("pin") for f in up.get("files") or []}
            lines += ["", "Test files: " + "; ".join(
                f"`{f}` at `{r}` (sha256 `{s}`, {'pinned' if s and pins.get((f, r)) == s else 'unpinned'})"
                for f, r, s in files) + "."]
    if "coverage" in p:
        lines += [""] + coverage.render(p["coverage"])[:-1]
    if p.get("live") is not None:
        lines += [""] + live.render(p)[:-1]
    lines += ["", "## Summary", ""]
    lines += [f"- {v}: {n}" for v, n in _pair_counts(summary)]
    lines.append(f"- must-preserve cases: {summary['must_preserve_cases']}")
    lines.append(f"- patched differs from reference: {summary['reference_differences']}")
    if summary.get("coverage"):
        c = summary["coverage"]
        lines.append(f"- patch lines executed by probes: {c['executed_by_probes']} of {c['added']} ({c['percent']}%)"
                     + ("; **below the floor** " if coverage.below_floor(p.get("coverage")) else "")
                     + (f" (floor {c['min_percent']}%)" if c["min_percent"] is not None else ""))
    if summary["findings"]:
        lines.append("- findings: " + ", ".join(f"{f['probe']}/{f['case']} ({f['pair']})"
                                               for f in summary["findings"]))
    lines += ["", ("Verdicts: fixed = unsafe on pristine, safe on patched; held = safe on both; "
                   "still-unsafe = unsafe on both; regressed = safe (or absent) on pristine, unsafe on patched; "
                   "added = absent on pristine, safe on patched; error = a tree could not be judged (a finding). "
                   "Check this bundle with `sglang-backport verify <bundle>` or `sha256sum -c SHA256SUMS`."), ""]
    return "\n".join(lines)
