"""The live tier in a bundle: `live/<role>.json` per tree, `predicate.live` and its share of the summary.

    predicate.live = {"scenarios": [{"scenario", "must_preserve", "verdicts": {role: verdict}, "pair",
                                     "reference_agrees"}],
                      "servers": {role: {version, flags, backend, router, model_sha256}},
                      "files": {role: "live/<role>.json"}}

Pair verdicts follow the probes' table (verdicts.pair_verdict) and count the same way: a live
finding (`regressed`, `error`, or `still-unsafe` outside the must-preserve set) fails the run.
Unlike probe results, a live document is a measurement (latencies, server log lines): two runs
on the same inputs give the same verdicts and tokens, not the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

from backport.evidence.verdicts import BASE, HEAD, PAIR_VERDICTS, REFERENCE, ROLES, is_finding, pair_verdict
from backport.records import LiveResult, ScenarioResult
from backport.vocab import RunResult, TreeVerdict

LIVE_DIR = "live"


def live_file(role: str) -> str:
    return f"{LIVE_DIR}/{role}.json"


def section(documents: dict[str, LiveResult]) -> dict:
    """predicate.live from the per-role live results (a run's, or its files read back)."""
    order: list[str] = []
    must: dict[str, bool] = {}
    verdicts: dict[str, dict[str, str]] = {}
    setups: dict[str, dict[str, dict]] = {}
    for role in ROLES:
        for item in documents[role].scenarios if role in documents else ():
            name = item.scenario
            if name not in must:
                order.append(name)
                must[name] = bool(item.must_preserve)
            verdicts.setdefault(name, {})[role] = item.verdict
            setup = race_setup(item)
            if setup is not None:
                setups.setdefault(name, {})[role] = setup
    present = [role for role in ROLES if role in documents]
    rows = []
    for name in order:
        seen = verdicts[name]
        rows.append(
            {
                "scenario": name,
                "must_preserve": must[name],
                "verdicts": {role: seen.get(role) for role in present},
                "pair": pair_verdict(seen.get(BASE), seen.get(HEAD)),
                "reference_agrees": (seen.get(HEAD) == seen.get(REFERENCE))
                if REFERENCE in documents
                else None,
            }
        )
        if name in setups:
            rows[-1]["runs"] = setups[name]
    return {"scenarios": rows,
            "servers": {role: documents[role].server for role in present},
            "files": {role: live_file(role) for role in present}}


def race_setup(item: ScenarioResult) -> dict | None:
    """What a topology scenario (the 2P1D page-lifetime race) ran: topology, shaping, environment,
    trials (run, valid, unsafe) and each control's result; None for a scenario of the pair."""
    details = item.details or {}
    if "topology" not in details:
        return None
    trials = details.get("trials") or []
    valid = [t for t in trials if not t.get("invalid")]
    controls = details.get("controls") or {}
    return {
        "topology": details["topology"],
        "shaping": details.get("shaping"),
        "environment": details.get("environment") or {},
        "trials": {
            "run": len(trials),
            "valid": len(valid),
            "unsafe": sum(1 for t in valid if not t.get("b_matches_reference")),
        },
        "controls": {
            name: TreeVerdict.SAFE if c.get("b_matches_reference") else TreeVerdict.UNSAFE
            for name, c in controls.items()
        },
        "released_through_timeout": details.get("released_through_timeout"),
    }


def findings(live: dict | None) -> list[dict]:
    return [{"scenario": r["scenario"], "pair": r["pair"], "must_preserve": r["must_preserve"]}
            for r in (live or {}).get("scenarios", []) if is_finding(r["pair"], r["must_preserve"])]


def fold_summary(summary: dict, live: dict | None) -> dict:
    """The run's summary with the live tier counted (unchanged when the run had no live tier)."""
    if live is None:
        return summary
    counts = {v: 0 for v in PAIR_VERDICTS}
    for row in live["scenarios"]:
        counts[row["pair"]] = counts.get(row["pair"], 0) + 1
    found = findings(live)
    folded = {
        **summary,
        "live": {"scenarios": len(live["scenarios"]), "pair_verdicts": counts, "findings": found},
    }
    if found or not live["scenarios"]:
        folded["result"] = RunResult.FAIL
    return folded


def section_problems(live: dict | None) -> list[str]:
    """predicate.live against itself: each pair verdict follows from its row's verdicts."""
    problems = []
    for row in (live or {}).get("scenarios", []):
        expected = pair_verdict(row["verdicts"].get(BASE), row["verdicts"].get(HEAD))
        if row.get("pair") != expected:
            problems.append(
                f"live scenario {row['scenario']}: pair verdict {row.get('pair')!r} does not follow "
                f"from {row['verdicts']} (expected {expected!r})"
            )
    return problems


def bundle_problems(bundle: Path, predicate: dict) -> list[tuple[str, str]]:
    """The live files against predicate.live: (file, problem) pairs."""
    live = predicate.get("live")
    if live is None:
        return []
    documents, problems = {}, []
    for role, name in live.get("files", {}).items():
        try:
            doc = json.loads((bundle / name).read_bytes())
        except (OSError, ValueError) as exc:
            problems.append((name, f"unreadable ({exc})"))
            continue
        try:  # read back into the type the run wrote it from
            documents[role] = LiveResult.from_json(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            problems.append((name, f"not a live document ({type(exc).__name__}: {exc})"))
    if problems:
        return problems
    expected = section(documents)
    for key in ("scenarios", "servers", "files"):
        if live.get(key) != expected[key]:
            problems.append((live_file(next(iter(documents), "pristine")),
                             f"predicate.live.{key} disagrees with the live files"))
    return problems


def render(predicate: dict) -> list[str]:
    """REPORT.md's "Live tier" section (ends with an empty line)."""
    live = predicate["live"]
    roles = [role for role in ROLES if role in live["servers"]]  # a receipt read back has sorted keys
    lines = [
        "## Live tier",
        "",
        (
            "A real PD deployment per tree: prefill and decode `launch_server` on the CPU, the router, "
            "Mooncake "
            "over TCP, a tiny seeded model; every request answered by the servers (details in "
            + ", ".join(f"`{live['files'][r]}`" for r in roles)
            + "). `*` marks a must-preserve scenario."
        ),
        "",
        "| scenario | " + " | ".join(roles) + " | pair | patched = reference |",
        "|" + "---|" * (len(roles) + 3),
    ]
    for row in live["scenarios"]:
        agree = {True: "yes", False: "**no**", None: "-"}[row["reference_agrees"]]
        pair = f"**{row['pair']}**" if is_finding(row["pair"], row["must_preserve"]) else row["pair"]
        lines.append(
            f"| {row['scenario']}{' *' if row['must_preserve'] else ''} | "
            + " | ".join(str(row["verdicts"].get(r) or "-") for r in roles)
            + f" | {pair} | {agree} |"
        )
    lines += ["", "| role | sglang | router | transfer backend |", "|---|---|---|---|"]
    for role in roles:
        server = live["servers"][role] or {}
        lines.append(
            f"| {role} | {server.get('version')} | {server.get('router')} | {server.get('backend')} |"
        )
    lines += _render_races(live, roles)
    found = findings(live)
    if found:
        lines += ["", "Live findings: " + ", ".join(f"{f['scenario']} ({f['pair']})" for f in found) + "."]
    return lines + [""]


def _render_races(live: dict, roles: list[str]) -> list[str]:
    """What each topology scenario ran, and what it does and does not show."""
    lines = []
    for row in live["scenarios"]:
        runs = row.get("runs") or {}
        if not runs:
            continue
        first = next(iter(runs.values()))
        topo, shaping = first["topology"], first.get("shaping") or {}
        lines += [
            "",
            (
                f"`{row['scenario']}`: {topo['name']} ({topo['prefills']} prefills, {topo['decodes']} "
                "decode, "
                f"{topo['network']}); only prefill A's Mooncake flow to decode shaped to "
                f"{shaping.get('rate')} "
                f"(htb); decode aborts A at {shaping.get('abort_at_fraction')} of A's "
                f"{topo['a_tokens']}-token KV, "
                f"then B ({topo['b_tokens']} tokens, {topo['b_new_tokens']} new) goes through prefill B onto "
                f"A's freed pages (decode pool {topo['decode_pool']})."
            ),
            "",
            "| role | trials (valid) | unsafe | controls | released through the timeout |",
            "|---|---|---|---|---|",
        ]
        for role in roles:
            run = runs.get(role)
            if run is None:
                continue
            controls = ", ".join(f"{n} {v}" for n, v in run["controls"].items()) or "-"
            lines.append(
                f"| {role} | {run['trials']['run']} ({run['trials']['valid']}) | {run['trials']['unsafe']} | "
                f"{controls} | {'yes' if run.get('released_through_timeout') else 'no'} |"
            )
        lines += [
            "",
            (
                "It shows decode releasing pages a writer may still touch, on real servers with the real "
                "Mooncake TCP transport: an abort mid-transfer lets the next request's KV be overwritten. It "
                "does "
                "not show RDMA (the writes are TCP on loopback, slowed by tc), GPU memory, or timings of a "
                "real "
                "network; the mechanism is the same one an RDMA write after release exercises."
            ),
        ]
    return lines
