"""REPORT.md: the receipt rendered for a human reader.

The report is a pure function of the receipt (timestamps aside), so `verify` can render the
receipt again and compare byte for byte.
"""

from __future__ import annotations

from typing import Any

from backport.advisories import render as advisories_section
from backport.evidence.verdicts import REFERENCE, ROLES, is_finding

from . import artifacts, coverage, live, scope, upstream_section


def _cell(value: Any) -> str:
    return "-" if value is None else str(value).replace("|", "\\|")


_pair_counts = scope.pair_counts


def _toolkit_line(p: dict) -> str:
    toolkit, env = p["toolkit"], p["environment"]
    code, dist = toolkit.get("code") or {}, toolkit.get("distribution") or {}
    installed = dist.get("installed_from", "unknown")
    if dist.get("wheel"):
        installed += f" `{dist['wheel']}` (sha256 `{dist.get('wheel_sha256') or 'not recorded'}`)"
    return (
        f"Toolkit sglang-backport {toolkit['version']} (commit "
        f"{toolkit['git_commit'] or 'none: not a git checkout'}"
        f"; installed from {installed}; code sha256: toolkit `{code.get('backport_sha256')}`, probes "
        f"`{code.get('probes_sha256')}`, probe requirements `{code.get('probe_requirements_sha256')}`). "
        f"Probe environment: Python {env['python']}, torch {env['torch']}, {env['platform']}."
    )


def render_report(statement: dict) -> str:
    p = statement["predicate"]
    target, trees, summary = p["inputs"]["target"], p["inputs"]["trees"], p["summary"]
    roles = [r for r in ROLES if r in p["probes"]]
    lines = [f"# Evidence: {target['spec']}", ""] + scope.render(statement)
    lines += [_toolkit_line(p), ""]
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
    if p["mode"] == "exposure":
        lines += [
            "",
            (
                f"Apply status: {p['apply'].get('status')}: "
                f"{scope.unserved_reason(scope.receipt_apply(p))}; no patched tree was built, so nothing "
                "here is a fix (the release stays exposed)."
            ),
        ]
    elif p["apply"] is not None:
        lines += [
            "",
            f"Apply status: {p['apply'].get('status')}; "
            f"head commit `{_cell(p['apply'].get('head_commit'))}`.",
        ]
    lines += [""] + artifacts.render(statement)[:-1]
    own_mark = "own check" if REFERENCE in roles else "-"
    pair_is = ("Pair = the pristine tree as shipped (an exposure run: no patched tree; unsafe reads "
               "still-unsafe, safe reads held)" if p["mode"] == "exposure" else "Pair = pristine -> patched")
    lines += [
        "",
        "## Cases",
        "",
        (
            pair_is + "; **bold** marks a finding. "
            "`*` marks a must-preserve case (behaviour every fix must keep). "
            "patched = reference: `yes` the patched tree's verdict equals the reference's, "
            "`**no**` it differs"
            + (
                ", `own check` a case of one of this pack's own checks, which the reference lacks "
                "(not compared: the reference is unsafe there by design)"
                if REFERENCE in roles
                else ", `-` no reference tree was probed"
            )
            + ". A `-` in a tree's column: that tree was not probed for the case."
        ),
        "",
    ]
    header = "| probe / case | " + " | ".join(roles) + " | pair | patched = reference |"
    lines += [header, "|" + "---|" * (len(roles) + 3)]
    for row in p["cases"]:
        name = f"{row['probe']} / {row['case']}{' *' if row['must_preserve'] else ''}"
        agree = {True: "yes", False: "**no**", None: own_mark}[row["reference_agrees"]]
        pair = f"**{row['pair']}**" if is_finding(row["pair"], row["must_preserve"]) else row["pair"]
        lines.append(f"| {_cell(name)} | " + " | ".join(_cell(row["verdicts"].get(r)) for r in roles)
                     + f" | {pair} | {agree} |")
    if p["reference_differences"]:
        lines += ["", "Patched differs from the reference in: "
                  + "; ".join(f"{d['probe']}/{d['case']} (patched {d['patched']}, reference {d['reference']})"
                              for d in p["reference_differences"]) + "."]
    lines += ["", "## Upstream tests", ""] + upstream_section.render(p["upstream_tests"], summary)
    if "coverage" in p:
        lines += [""] + coverage.render(p["coverage"])[:-1]
    if p.get("live") is not None:
        lines += [""] + live.render(p)[:-1]
    if p.get("advisories"):
        lines += [""] + advisories_section(p["advisories"], ROLES)
    lines += ["", "## Summary", ""]
    lines += [f"- {v}: {n}" for v, n in _pair_counts(summary)]
    lines.append(f"- must-preserve cases: {summary['must_preserve_cases']}")
    lines.append(f"- {scope.reference_comparison(p)}")
    if summary.get("coverage"):
        c = summary["coverage"]
        lines.append(
            f"- patch lines executed by probes: {c['executed_by_probes']} of {c['added']} ({c['percent']}%)"
            + ("; **below the floor** " if coverage.below_floor(p.get("coverage")) else "")
            + (f" (floor {c['min_percent']}%)" if c["min_percent"] is not None else "")
        )
    lines += upstream_section.summary_lines(summary)
    if summary["findings"]:
        lines.append("- findings: " + ", ".join(f"{f['probe']}/{f['case']} ({f['pair']})"
                                               for f in summary["findings"]))
    lines += [
        "",
        (
            "Verdicts: fixed = unsafe on pristine, safe on patched; held = safe on both; "
            "still-unsafe = unsafe on both; regressed = safe (or absent) on pristine, unsafe on patched; "
            "added = absent on pristine, safe on patched; error = a tree could not be judged (a finding). "
            "Check this bundle with `sglang-backport verify <bundle>` or `sha256sum -c SHA256SUMS`."
        ),
        "",
        scope.covers_line(p),
        "",
    ]
    return "\n".join(lines)
