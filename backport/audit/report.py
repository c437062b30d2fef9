"""The audit as a JSON document (automation) and as Markdown (a reviewer attaches it)."""

from __future__ import annotations

from collections.abc import Sequence

from backport import __version__
from backport.advisories import EXPOSED_IF, OPEN, Row
from backport.advisories import markdown as advisories_table
from backport.audit.code import CodeFacts
from backport.audit.gates import FAIL, PASS, UNKNOWN, GateResult, worst
from backport.audit.servers import ServerFacts

SCHEMA = "sglang-backport/audit/1"


def exit_code(gates: tuple[GateResult, ...], *, allow_unknown: bool = False) -> int:
    """1 when any gate fails, or is `unknown` (not verified is never a pass; `--allow-unknown`
    lets unknown gates through); 0 otherwise (`pass` and `warn`)."""
    if any(g.verdict == FAIL for g in gates):
        return 1
    return 1 if not allow_unknown and any(g.verdict == UNKNOWN for g in gates) else 0


def to_json(gates: tuple[GateResult, ...], code: CodeFacts | None, servers: tuple[ServerFacts, ...], *,
            allow_unknown: bool = False, advisories: Sequence[Row] = ()) -> dict:
    return {
        "schema": SCHEMA,
        "toolkit_version": __version__,
        "verdict": worst(g.verdict for g in gates),
        "exit_code": exit_code(gates, allow_unknown=allow_unknown),
        "code": code.to_json() if code else None,
        "servers": [s.to_json() for s in servers],
        "gates": [g.to_json() for g in gates],
        "advisories": [r.to_json() for r in advisories],
    }


def terminal(
    gates: tuple[GateResult, ...], servers: tuple[ServerFacts, ...] = (), advisories: Sequence[Row] = ()
) -> str:
    # an unread server's reason is printed once, here; the gates it leaves unknown point back to it
    unread = [s for s in servers if s.error]
    lines = [f"server {s.url}: not read: {s.error}" for s in unread]
    first_under: dict[str, int] = {}   # a long line shared by gates is printed under the first only
    for g in gates:
        lines.append(f"gate {g.gate} {g.name}: {g.verdict.upper()}")
        for line in g.evidence:
            if g.remedy and line in g.remedy:
                continue   # printed as the remedy below
            for s in unread:
                line = line.replace(f"not read: {s.error}", "not read (above)")
            if len(line) > 60 and first_under.setdefault(line, g.gate) != g.gate:
                line = f"{line[:40]}... (as under gate {first_under[line]})"
            lines.append(f"    {line}")
        if g.remedy:
            lines.append(f"    remedy: {g.remedy}")
    overall = worst(g.verdict for g in gates)
    unverified = [str(g.gate) for g in gates if g.verdict == UNKNOWN]
    tail = (f"; not verified: gate {', '.join(unverified)} (exit 1 unless --allow-unknown)"
            if unverified else "")
    lines.append(f"overall: {overall.upper()}{tail}")
    lines += _advisory_lines(advisories)
    return "\n".join(lines)


def _advisory_lines(advisories: Sequence[Row]) -> list[str]:
    """The open advisories and those open under a condition not seen (the rest is in --json and
    --report), after the verdict: information, not a gate."""
    shown = [r for r in advisories if r.status in (OPEN, EXPOSED_IF)]
    if not advisories:
        return []
    opened = sum(r.status == OPEN for r in advisories)
    lines = [
        f"advisories: {opened} open of {len(advisories)} rows (not a gate; every row in --json and --report)"
    ]
    lines += [
        f"    {r.status}: {r.advisory}{' (' + ', '.join(r.aliases) + ')' if r.aliases else ''} on "
        f"{r.subject}: "
        f"{r.reason}; {r.pack}"
        for r in shown
    ]
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(gates: tuple[GateResult, ...], code: CodeFacts | None, servers: tuple[ServerFacts, ...],
             advisories: Sequence[Row] = ()) -> str:
    overall = worst(g.verdict for g in gates)
    out = ["# SGLang PD deployment audit: the four operator gates", "",
           (f"Overall: **{overall}** (sglang-backport {__version__}). Gates from the incident analysis: "
           "pool versus context, rejection at admission, transfer covers read, page lifetime. "
           "`unknown` means the evidence was not available; it is not a pass."), "",
           "| gate | verdict |", "| --- | --- |"]
    out += [f"| {g.gate}. {g.name} | **{g.verdict}** |" for g in gates]
    out += ["", "## What was examined", ""]
    if code is not None:
        out.append(f"- Code: {code.how}, sglang {code.version}, package root `{code.package_root}`; "
                   f"probes run by {code.harness}.")
    else:
        out.append("- Code: none given.")
    if servers:
        out += ["", "| server | endpoint | role | version | backend | pool (tokens) | context | page size |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in servers:
            if s.error:
                out.append(f"| {s.url} | - | not read: {_cell(s.error)} | | | | | |")
                continue
            pool = f"{s.pool_tokens:,}" if s.pool_tokens is not None else "-"
            ctx = f"{s.context_length:,}" if s.context_length is not None else "-"
            out.append(
                f"| {s.url} | {s.endpoint} | {s.role or '-'} | {s.version or '-'} | {s.backend or '-'} "
                f"| {pool} | {ctx} | {s.page_size if s.page_size is not None else '-'} |"
            )
    else:
        out.append("- Servers: none given.")
    for g in gates:
        out += ["", f"## Gate {g.gate}: {g.name}: {g.verdict}", ""]
        out += [f"- {_cell(line)}" for line in g.evidence]
        if g.remedy:
            out += ["", f"Remedy: {g.remedy}"]
    if overall != PASS:
        out += ["", "A gate that is not `pass` is not verified for this deployment."]
    if advisories:
        out += ["", "## What else is open on this release", "",
                "Known advisories beyond the four gates (information, not a gate).", ""]
        out += advisories_table(advisories)
    return "\n".join(out) + "\n"
