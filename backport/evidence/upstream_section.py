"""REPORT.md's "Upstream tests" section: per fix and file the pair, every outcome with its reason
and revision, and each file's provenance ("pinned" only for bytes that matched the pin)."""

from __future__ import annotations

from backport.evidence.verdicts import ROLES


def _cell(value) -> str:
    return "-" if value is None else str(value).replace("|", "\\|")


def _tree_cell(entry: dict | None) -> str:
    if not entry:
        return "-"
    counts = ", ".join(f"{n} {o}" for o, n in sorted(entry.get("counts", {}).items()))
    sub = entry.get("subtests") or {}
    if sub:
        counts += " + " + ", ".join(f"{n} subtests {o}" for o, n in sorted(sub.items()))
    return f"**{entry['outcome']}** ({counts})" if entry["outcome"] != "passed" else f"passed ({counts})"


def _provenance(f: dict) -> str:
    where = f"`{f.get('path')}` at `{f.get('rev')}`"
    if f.get("refused"):
        return f"{where}: **refused**, never run (received sha256 `{_cell(f.get('sha256'))}`, pin " \
               f"`{_cell(f.get('pin'))}`): {f['refused']}"
    if f.get("unavailable"):
        return f"{where}: **unavailable**, not fetched: {f['unavailable']}"
    if f.get("error"):
        return f"{where}: **error**: {f['error']}"
    if f.get("sha256") and f.get("pin") and f.get("sha256") == f.get("pin"):
        return f"{where}: pinned (sha256 `{f['sha256']}` matches fixes.toml)"
    if f.get("sha256"):
        return f"{where}: unpinned (sha256 `{f['sha256']}`, no pin in fixes.toml: trusted on first use)"
    return f"{where}: not run"


def render(up: dict, summary: dict) -> list[str]:
    lines: list[str] = []
    evidence = summary.get("upstream_evidence") or {}
    if evidence:
        with_ = evidence.get("with_evidence") or []
        lines.append(f"Upstream evidence for {len(with_)} of {evidence.get('fixes', 0)} fixes"
                     + (f" ({', '.join(with_)})" if with_ else "") + ".")
        without = evidence.get("without_evidence") or {}
        if without:
            lines += ["", "No upstream evidence for:"] + [
                f"- {fix}: {why}" for fix, why in sorted(without.items())
            ]
        lines.append("")
    if up.get("skipped"):
        lines += [f"Skipped: {up['skipped']}", ""]
    rows = evidence.get("files") or []
    roles = [r for r in ROLES if any(r in row["trees"] for row in rows)]
    if rows:
        lines += [
            (
                "Pair = pristine -> patched, per test file: fixed (failed -> passed), held, passed (patched "
                "only), still-failing, regressed, refused (pin mismatch), inconclusive (stale-test, "
                "incompatible, unavailable, skipped: never a pass). Bold pair: a finding."
            ),
            "",
        ]
        lines += [
            "| fix | file @ revision | " + " | ".join(roles) + " | pair |",
            "|" + "---|" * (len(roles) + 3),
        ]
        for row in rows:
            pair = f"**{row['pair']}**" if row["finding"] else row["pair"]
            if row["pair"] == "still-failing" and not row["finding"]:
                pair += f" (fix {row.get('fix_status')} on this release)"
            name = f"`{str(row['file']).rsplit('/', 1)[-1]}` @ `{str(row['rev'])[:12]}`"
            lines.append(f"| {_cell(row['fix'])} | {name} | "
                         + " | ".join(_tree_cell(row["trees"].get(r)) for r in roles) + f" | {pair} |")
        lines.append("")
    results: dict[tuple, dict[str, dict]] = {}
    test_roles: list[str] = []
    for tree in up.get("trees") or []:
        test_roles.append(str(tree.get("tree")))
        for test in tree.get("tests") or []:
            key = (test.get("nodeid") or test.get("file"), test.get("rev"))
            results.setdefault(key, {})[str(tree.get("tree"))] = test
    if results:
        lines += [
            "| test | revision | " + " | ".join(test_roles) + " |",
            "|" + "---|" * (len(test_roles) + 2),
        ]
        for key in sorted(results, key=lambda k: tuple(str(x) for x in k)):
            lines.append(
                f"| `{_cell(key[0])}` | `{str(key[1])[:12]}` | "
                + " | ".join(_cell((results[key].get(r) or {}).get("outcome")) for r in test_roles)
                + " |"
            )
        reasons: dict[tuple, list[str]] = {}
        for key, per_tree in results.items():
            for role in test_roles:
                test = per_tree.get(role)
                if test and test.get("outcome") != "passed":
                    reasons.setdefault((key, test.get("outcome"), test.get("reason")), []).append(role)
        if reasons:
            lines += ["", "Every outcome other than passed, with its reason:"]
            for (key, outcome, reason), where in sorted(
                reasons.items(), key=lambda kv: tuple(str(x) for x in kv[0])
            ):
                lines.append(f"- `{key[0]}` @ `{str(key[1])[:12]}` on {', '.join(where)}: {outcome}"
                             + (f": {reason}" if reason else ""))
        lines.append("")
    elif not up.get("skipped"):
        lines += ["No upstream test ran.", ""]
    files = up.get("files") or []
    if files:
        lines += ["Test files:"] + [f"- {_provenance(f)}" for f in sorted(
            files, key=lambda f: (str(f.get("path")), str(f.get("rev"))))]
    while lines and lines[-1] == "":
        lines.pop()
    return lines


def summary_lines(summary: dict) -> list[str]:
    """The Summary section's upstream lines."""
    evidence = summary.get("upstream_evidence")
    if not evidence:
        return []
    pairs = ", ".join(f"{n} {p}" for p, n in evidence.get("pairs", {}).items() if n) or "none"
    lines = [
        (
            f"- upstream test files (pair): {pairs}; upstream evidence for "
            f"{len(evidence.get('with_evidence') or [])} "
            f"of {evidence.get('fixes', 0)} fixes"
        )
    ]
    if evidence.get("findings"):
        lines.append("- upstream test findings: " + ", ".join(
            f"{f['fix']} {str(f['file']).rsplit('/', 1)[-1]}@{str(f['rev'])[:8]} ({f['pair']})"
            for f in evidence["findings"]))
    return lines
