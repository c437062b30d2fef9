"""The top of REPORT.md: what ran, what was not proven, then the result and what to deploy.

A reader who stops after these lines must not believe more than ran: the probes ran on a CPU with
named stand-ins, the live tier and upstream's tests are "not run" unless the receipt holds their
results, and the operating caveats that no case can prove are listed every time.
"""

from __future__ import annotations

from backport.engine.report import MISSING_DEPENDENCY, NO_VARIANT, ApplyReport
from backport.errors import Finding
from backport.evidence.verdicts import PAIR_VERDICTS, REFERENCE, ROLES
from backport.vocab import PatchStatus, TreeVerdict

# Where a GPU, RDMA or a model would be needed (probes/standins/, probes/rigs/).
STAND_INS = (
    "`RecordingKVSender`/`RecordingKVReceiver` (the KV transfer), `CountingPageAllocator` (the "
    "GPU KV pool), `SchedulerShell` (the tree's own `Scheduler` built without its constructor), "
    "stand-in transfer engines, a NIXL agent and a Mori I/O engine without a NIC (RDMA), "
    "`probes/standins/shims/` (`torchvision`, `sgl_kernel`, `vllm`, `decord`, `mori`) where "
    "absent, and `probes/standins/addons.py` (names older releases read that torch 2.13 and "
    "triton dropped) where missing, and its 3FS client module where a wheel lacks the C++ source "
    "that module compiles at import (0.4.10)"
)
# The rollback of an exported wheel: `==X` alone is satisfied by `X+backport.N` (PEP 440), hence the flags.
ROLLBACK = "pip install --force-reinstall --no-deps 'sglang=={version}'"
COVERAGE_SWITCH = "SGLANG_DISAGGREGATION_TRANSFER_COVERAGE_CHECK=0"


def pair_counts(summary: dict) -> list[tuple[str, int]]:
    """The pair verdict counts in the table's order (a receipt read back has its keys sorted)."""
    counts = summary["pair_verdicts"]
    order = [v for v in PAIR_VERDICTS if v in counts] + sorted(v for v in counts if v not in PAIR_VERDICTS)
    return [(v, counts[v]) for v in order]


def reference_comparison(predicate: dict) -> str:
    """How patched compares with the reference, the pack's own check counted on its own."""
    if REFERENCE not in predicate["probes"]:
        return "no reference tree was probed"
    rows = predicate["cases"]
    compared = [r for r in rows if r["reference_agrees"] is not None]
    own = len(rows) - len(compared)
    text = (
        f"patched differs from the reference in {sum(1 for r in compared if r['reference_agrees'] is False)} "
        f"of {len(compared)} compared cases"
    )
    if own:
        unsafe = sum(
            1
            for r in rows
            if r["reference_agrees"] is None
            and r["verdicts"].get(REFERENCE) not in (TreeVerdict.SAFE, None)
            and r["verdicts"].get("patched") == TreeVerdict.SAFE
        )
        text += (f"; {own} case(s) of this pack's own checks are counted apart, not compared (the reference "
                 f"lacks them; {unsafe} of them safe on patched and unsafe on the reference, by design)")
    return text


def _upstream_line(up: dict) -> tuple[str, bool]:
    """(what ran of upstream's tests, whether any ran)."""
    files = {(f.get("path"), f.get("rev")) for f in up.get("files") or [] if isinstance(f, dict)}
    if up.get("skipped"):
        listed = f"; {len(files)} test file(s) listed for the fixes, none ran" if files else ""
        return f"not run ({up['skipped']}){listed}", False
    outcomes: dict[str, int] = {}
    ran_files = set()
    trees = []
    for tree in up.get("trees") or []:
        trees.append(str(tree.get("tree")))
        for test in tree.get("tests") or []:
            outcome = str(test.get("outcome"))
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            ran_files.add((test.get("file"), test.get("rev")))
    ran = sum(n for o, n in outcomes.items() if o != "skipped")
    missing = len(files - ran_files) if files else 0
    if not outcomes:
        return f"no test ran ({len(files)} test file(s) listed)", False
    detail = ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
    return (
        (
            f"{ran} ran, {outcomes.get('skipped', 0)} skipped by pytest, {missing} listed file(s) without a "
            "result, "
            f"on {', '.join(trees)} ({detail})"
        ),
        ran > 0,
    )


def covers_line(predicate: dict) -> str:
    """The result and what it rests on, in one line: REPORT.md's last and `run`'s last. A PASS
    speaks for the trees probed, never for how a deployment is configured (the incident's trigger)."""
    s, live, up = predicate["summary"], predicate.get("live"), predicate["upstream_tests"]
    ran = _upstream_line(up)[1]
    upstream = "run" if ran else "skipped" if up.get("skipped") else "none ran"
    live_tier = f"yes ({len(live.get('scenarios') or [])} scenarios)" if live else "no"
    return (
        f"{s['result'].upper()} covers: CPU probes ({s['cases']} cases); live tier: {live_tier}; upstream "
        "tests: "
        f"{upstream}. A deployment's own configuration is not judged here: check it with "
        f"`sglang-backport audit`."
    )


def render(statement: dict) -> list[str]:
    """The report's first lines (after its title)."""
    p = statement["predicate"]
    trees, summary, env = p["inputs"]["trees"], p["summary"], p["environment"]
    roles = [r for r in ROLES if r in p["probes"]]
    described = ", ".join(
        f"{role} (sglang {trees[role]['version']})" if role in trees else role for role in roles
    )
    upstream, upstream_ran = _upstream_line(p["upstream_tests"])
    live = p.get("live")
    lines = exposure_lines(p) + [
        "## Scope",
        "",
        "What ran:",
        "",
        (
            f"- CPU probes: {summary['cases']} cases on {len(roles)} tree(s), {described}: each tree's real "
            f"SGLang modules imported in the probe environment (Python {env.get('python')}, torch "
            f"{env.get('torch')}) on a CPU, with named stand-ins where a GPU, RDMA or a model would be "
            f"needed: {STAND_INS}."
        ),
        "- Live tier (real prefill and decode servers): "
        + ("ran; see its section below." if live else "not run; no server answered a request."),
        f"- Upstream's unit tests: {upstream}.",
        "",
        "Not proven by this bundle:",
        "",
        "- Behaviour on a GPU, over RDMA or with a real model: no case ran there.",
    ]
    if not live:
        lines.append(
            "- A served deployment: no server was started, so nothing here rests on a request answered."
        )
    if not upstream_ran:
        lines.append("- That upstream's own unit tests pass on these trees.")
    not_executed = (summary.get("coverage") or {}).get("not_executed")
    if not_executed:
        lines.append(
            f"- {not_executed} executable line(s) the patches add that no case executed (listed under "
            f"Coverage): they are reviewed, not proven."
        )
    lines += [
        (
            "- That writes have stopped when the deferred-release timeout fires: "
            "`SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT` releases held pages without every "
            "drain ACK, "
            "so a write still in flight can land on reused pages; treat every \"Deferred KV release ... "
            "timed out\" "
            "warning as a possible exposure."
        ),
        (
            "- Prefill-side source pages freed while a chunk is still in flight (upstream #38961, open): no "
            "release "
            "and no patch of this pack closes it."
        ),
        "- A deployment where only one side runs the pack: both prefill and decode must run it "
        "(see Rollout).",
        "",
        f"Result: **{summary['result'].upper()}** ({summary['cases']} cases; "
        + ", ".join(f"{n} {v}" for v, n in pair_counts(summary) if n)
        + "); "
        + reference_comparison(p)
        + ".",
        "",
    ]
    return lines + rollout(statement)


def unserved_fixes(apply: ApplyReport | None) -> tuple[list[str], list[str]] | None:
    """The one reading of "the pack cannot serve this release": (fixes with no variant for it, fixes
    that failed only because they depend on one), or None when it can. A variant that exists and does
    not place is a defect of the pack, not this. Read from the patches' causes, never their reasons."""
    failed = [x for x in (apply.patches if apply else ()) if x.status == PatchStatus.FAILED]
    lacking = [x.fix for x in failed if x.cause == NO_VARIANT]
    waiting = [x.fix for x in failed if x.cause == MISSING_DEPENDENCY]
    if not lacking or len(lacking) + len(waiting) != len(failed):
        return None
    return lacking, waiting


def unserved_reason(apply: ApplyReport | None) -> str:
    """Why the pack cannot serve a release: the fixes with no variant for it (apply-report.json
    lists the variants each one has)."""
    fixes = unserved_fixes(apply)
    if fixes is None:
        return "the series does not apply"
    lacking, waiting = fixes
    return (f"no variant of {', '.join(lacking)} for this release"
            + (f", and {', '.join(waiting)} depend(s) on it" if waiting else ""))


def exposure_line(version: str, apply: ApplyReport | None) -> str:
    """The one line an exposure run prints: the release, why the pack cannot serve it, that it stays
    exposed."""
    return (f"sglang {version} stays exposed: the pack cannot serve it ({unserved_reason(apply)}); "
            f"its pristine tree was probed to show the exposure, no patched tree was built")


def receipt_apply(p: dict) -> ApplyReport | None:
    """The apply report a receipt's predicate carries (None: no apply ran), read back typed; one that
    does not read as a report is a finding about the bundle, never a traceback."""
    if p.get("apply") is None:
        return None
    try:
        return ApplyReport.from_json(p["apply"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise Finding(f"the bundle's apply report does not read as one "
                      f"({type(exc).__name__}: {exc})") from None


def exposure_lines(p: dict) -> list[str]:
    if p["mode"] != "exposure":
        return []
    return [
        "## Exposure",
        "",
        (
            f"**{exposure_line(p['inputs']['target']['version'], receipt_apply(p))}.** This bundle "
            "is about the release as shipped: the cases below are its pristine tree's verdicts, the VEX "
            "documents state `affected` where a case is unsafe on it, and nothing here claims a fix."
        ),
        "",
    ]


def rollout(statement: dict) -> list[str]:
    """What to deploy, in which order, and how to roll back (a backport run only)."""
    p = statement["predicate"]
    applied = any(x.get("status") == PatchStatus.APPLIED for x in p["inputs"]["patches"])
    if p["mode"] != "backport" or not applied:
        return []
    version = p["inputs"]["target"].get("version")
    export = p.get("export")
    wheel = (f"`{export['wheel']['file']}` (version {export['wheel']['version']}, in this bundle's `export/`)"
             if export else "the patched wheel of this tree (not exported by this run: `sglang-backport run "
                            "--export`, or `apply --out DIR` then `export DIR --wheel dist/`, writes it)")
    rollback = (f"`{ROLLBACK.format(version=version)}` from the package index, or the upstream wheel by file"
                if p["inputs"]["target"].get("kind") == "wheel" else "reinstall the tree you ran before")
    return [
        "## Rollout",
        "",
        f"What to deploy: {wheel}, on every prefill and every decode node, in this order:",
        "",
        (
            "1. Prefill first: a patched prefill with an unpatched decode is harmless (it records the "
            "transferred coverage in a spare slot, and sends drain ACKs an old decode ignores)."
        ),
        (
            "2. Then decode. While versions are mixed, a patched decode refuses every handoff from an "
            "unpatched "
            f"prefill (HTTP 500, `transfer_coverage/unpatched_peer_refused`): set `{COVERAGE_SWITCH}` on "
            "decode "
            "until every prefill runs the pack, then unset it."
        ),
        (
            f"3. Roll back in reverse: decode first (or set `{COVERAGE_SWITCH}` on it), then prefill. "
            "Rollback: "
            f"{rollback}; a plain `pip install sglang=={version}` keeps the `+backport` build (PEP 440: the "
            "local version satisfies `==`)."
        ),
        (
            "4. Check each node: `sglang-backport status installed --python EXE` says which patch set it "
            "runs, "
            "the role order and whether its peer must be patched too."
        ),
        "",
    ]
