"""What to change for each gate that is not `pass`, and the command that checks it again.

A verdict without a way out leaves the operator where the incident left Cloudflare: every
non-pass gate names the concrete change (the flag, a value computed from the servers' own
numbers, the environment variable) and ends with the audit command to re-run. The gates decide;
this module only words the way out from the same facts.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex

from backport.audit.code import COVERAGE_ENV, DEFERRED_ENV, MOONCAKE_TCP_PROTO, TIMEOUT_ENV, CodeFacts
from backport.audit.gates import PASS, GateResult
from backport.audit.servers import CHECKSUM_FLAG, PD_ROLES, ServerFacts

CHECKSUM_OPTION = "--" + CHECKSUM_FLAG.replace("_", "-")


def recheck_command(args, *, extra: str = "", env: str = "") -> str:
    """The audit as it was run (the API key itself never printed), with `extra` flags added."""
    words = ["sglang-backport", "audit"]
    if args.tree:
        words.append(args.tree)
    if args.python:
        words += ["--python", args.python]
    for url in args.server:
        words += ["--server", url]
    if args.live:
        words += ["--live", args.live]
    command = " ".join(shlex.quote(w) for w in words)
    if getattr(args, "api_key", None):
        command += " --api-key KEY"
    if getattr(args, "max_prompt_tokens", 1_048_576) != 1_048_576 and "--max-prompt-tokens" not in extra:
        command += f" --max-prompt-tokens {args.max_prompt_tokens}"
    return " ".join(part for part in (env, command, extra) if part)


def _unread(gate: GateResult) -> list[str]:
    """The change that lets the audit read the servers it could not: a key, the right URL, a route."""
    unread = [s for s in gate.servers if s.evidence.startswith("not read")]
    keyed = [s.url for s in unread if "--api-key" in s.evidence]
    moved = [s.url for s in unread if "redirect to" in s.evidence]
    other = [s.url for s in unread if s.url not in keyed + moved]
    return (
        ([f"re-run with --api-key KEY ({', '.join(keyed)} refused the audit)"] if keyed else [])
        + (
            [f"give the URL each server answers on itself ({', '.join(moved)} redirect elsewhere)"]
            if moved
            else []
        )
        + ([f"make {', '.join(other)} reachable from here (the reason is under the server)"] if other else [])
    )


def _pool(gate: GateResult, recheck) -> str:
    documents = gate.details.get("servers") or []
    short = [
        d
        for d in documents
        if d.get("role") in PD_ROLES
        and isinstance(d.get("max_total_num_tokens"), int)
        and isinstance(d.get("context_length"), int)
        and d["max_total_num_tokens"] < d["context_length"]
    ]
    changes = []
    live = gate.details.get("live") or {}
    if live.get("remedy"):
        changes.append(f"re-run with {live['remedy']} (the router's workers were not read without it)")
        recheck = functools.partial(recheck, extra=live["remedy"])
    if short:
        pools = [d["max_total_num_tokens"] for d in documents
                 if d.get("role") in PD_ROLES and isinstance(d.get("max_total_num_tokens"), int)]
        context = max(d["context_length"] for d in short)
        fractions = {d["mem_fraction_static"] for d in short if d.get("mem_fraction_static") is not None}
        now = f" (now {', '.join(f'{f:g}' for f in sorted(fractions))})" if fractions else ""
        needs = "; ".join(
            f"{d['url']} needs {d['context_length'] / d['max_total_num_tokens']:.2f}x its pool of "
            f"{d['max_total_num_tokens']:,}"
            for d in short
        )
        changes.append(
            f"restart every prefill and decode node with --context-length {min(pools)} (the smallest "
            f"KV pool reported), or give the pools room for the context of {context:,} tokens: raise "
            f"--mem-fraction-static{now} or the parallelism (--tp-size), then confirm max_total_num_tokens "
            f">= {context:,} in /server_info ({needs})"
        )
    for d in documents:
        if (
            d.get("role") not in PD_ROLES
            and isinstance(d.get("max_total_num_tokens"), int)
            and isinstance(d.get("context_length"), int)
            and d["max_total_num_tokens"] < d["context_length"]
        ):
            changes.append(f"before {d['url']} joins a PD pair, start it with --context-length "
                           f"{d['max_total_num_tokens']}")
    changes += _unread(gate)
    if any(s.verdict != PASS and not s.evidence.startswith("not read") and any(
            w in s.evidence for w in ("missing", "not reported", "role unknown", "not an integer", "not set"))
           for s in gate.servers):
        changes.append(
            "give each prefill and decode node's own URL as --server (its /server_info reports "
            "disaggregation_mode, max_total_num_tokens and context_length; a router or proxy does not)"
        )
    if not gate.servers and not documents and not changes:
        return (
            f"give every prefill and decode node as --server URL; re-check: `{recheck(extra='--server URL')}`"
        )
    return "; ".join(changes or ["see the evidence"]) + f"; re-check: `{recheck()}`"


def _admission(gate: GateResult, code: CodeFacts | None, recheck) -> str:
    changes, extra = [], []
    live = gate.details.get("live") or {}
    if live.get("remedy"):
        changes.append(f"re-run with {live['remedy']} (the live case was not judged without it)")
        extra.append(live["remedy"])
    if code is None:
        changes.append(
            "give the code the servers run: --python EXE (the serving environment's interpreter) or "
            "the TREE it was installed from"
        )
        extra.append("--python EXE")
    elif gate.remedy:   # the gate's own: which fix is missing and the command that backports it
        changes.append(gate.remedy)
    elif any("runs sglang" in e or "does not report its version" in e for e in gate.evidence):
        changes.append("audit the code each server runs: --python of the environment the servers start from "
                       "(the versions differ above)")
    elif any(e.startswith(("  unsafe", "  error")) for e in gate.evidence):
        changes.append(
            "the fixes' fingerprints are present but a probe case is unsafe: install the build the "
            "toolkit proved (`sglang-backport run sglang==VERSION --export`, its export/ wheel) on every "
            "prefill node, then every decode node"
        )
    return "; ".join(changes or ["the reason is in the evidence above"]) + \
        f"; re-check: `{recheck(extra=' '.join(extra))}`"


def _transfer(gate: GateResult, code: CodeFacts | None, servers: tuple[ServerFacts, ...], recheck) -> str:
    pd = [s for s in servers if s.is_pd]
    on = [s.url for s in pd if s.kv_checksum is True]
    off = [s.url for s in pd if s.kv_checksum is False]
    changes = []
    if on and off:
        changes.append(
            f"start {', '.join(off)} with {CHECKSUM_OPTION} (it is on for {', '.join(on)}: both sides "
            "or neither)"
        )
    elif off:
        changes.append(
            f"start every prefill and decode node with {CHECKSUM_OPTION} ({', '.join(off)} run without it)"
        )
    if code is not None and code.coverage_check is not None and code.coverage_check.value is not True:
        changes.append(
            f"set {COVERAGE_ENV}=1 in the environment of every prefill and decode node (this pack's "
            "transferred-coverage check is in the code but not on)"
        )
    elif not on and not off:
        reported = sorted({s.version for s in pd if s.version})
        version = (
            code.version if code and code.version else (reported[0] if len(reported) == 1 else "VERSION")
        )
        changes.append(
            f"install this pack's patched build, whose transferred-coverage check is on by default "
            f"(`sglang-backport run sglang=={version} --export`), or upgrade to SGLang 0.5.22 and start "
            f"prefill and decode with {CHECKSUM_OPTION}"
        )
    roles = {s.role for s in pd}
    if not set(PD_ROLES) <= roles:
        changes.append("give a prefill and a decode node as --server: the check must hold on both sides")
    changes += _unread(gate)
    return "; ".join(changes) + f"; re-check: `{recheck()}`"


def _lifetime(gate: GateResult, code: CodeFacts | None, servers: tuple[ServerFacts, ...], recheck) -> str:
    if code is None:
        return ("give the code the servers run: --python EXE or the TREE; re-check: "
                f"`{recheck(extra='--python EXE')}`")
    changes, env = [], ""
    if gate.remedy:
        changes.append(gate.remedy)
    if code.deferred_release.value is not True:
        changes.append(
            f"set {DEFERRED_ENV}=1 in the environment of every decode node (and of this audit, which "
            "cannot read the servers' environment)"
        )
        env = f"{DEFERRED_ENV}=1"
    if code.timeout.value is not None and code.timeout.value <= 0:
        changes.append(f"set {TIMEOUT_ENV} to a positive number of seconds above the worst-case drain of one "
                       "transfer chunk")
    if code.extra.get("mooncake_tcp_proto") == "1":
        changes.append(
            f"unset {MOONCAKE_TCP_PROTO} on every prefill and decode node (and in this audit's environment)"
        )
    capable = code.capable_backends or ()
    stuck = sorted({s.backend for s in servers if s.is_pd and s.backend and s.backend not in capable})
    if stuck:
        changes.append(
            f"move prefill and decode from {', '.join(stuck)} to --disaggregation-transfer-backend "
            + (" or ".join(capable) if capable else "of a release that holds pages (SGLang 0.5.22)")
        )
    if not set(PD_ROLES) <= {s.role for s in servers if s.is_pd}:
        changes.append(
            "give a prefill and a decode node as --server: an unpatched prefill sends no drain ACK"
        )
    if any("runs sglang" in e or "does not report its version" in e for e in gate.evidence):
        changes.append("audit the code each server runs (--python of their environment)")
    return "; ".join(changes or ["the reason is in the evidence above"]) + f"; re-check: `{recheck(env=env)}`"


def attach(results: tuple[GateResult, ...], code: CodeFacts | None, servers: tuple[ServerFacts, ...],
           args) -> tuple[GateResult, ...]:
    """Every non-pass gate with its remedy and re-check command."""
    def recheck(extra: str = "", env: str = "") -> str:
        return recheck_command(args, extra=extra, env=env)

    words = {
        1: lambda g: _pool(g, recheck),
        2: lambda g: _admission(g, code, recheck),
        3: lambda g: _transfer(g, code, servers, recheck),
        4: lambda g: _lifetime(g, code, servers, recheck),
    }
    return tuple(g if g.verdict == PASS else dataclasses.replace(g, remedy=words[g.gate](g)) for g in results)
