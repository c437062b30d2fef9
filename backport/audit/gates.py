"""The four operator gates, one function each, from facts about servers and code to a verdict.

Verdicts: `pass` (the evidence shows the gate holds), `fail` (the evidence shows it does not),
`warn` (holds only partly, or nothing can hold it on this release), `unknown` (the evidence
needed is missing, with the reason). A gate is as bad as its worst part: fail > unknown >
warn > pass, so a missing field can never turn into a pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from backport.audit.code import (
    ADMISSION_FIXES,
    ADMISSION_PROBES,
    COVERAGE_FIX,
    MOONCAKE_TCP_PROTO,
    PAGE_LIFETIME_FIXES,
    CodeFacts,
)
from backport.audit.servers import CHECKSUM_FLAG, PD_ROLES, ServerFacts
from backport.export.label import same_build  # 0.5.19+backport.N is not a pristine or rolled-back 0.5.19
from backport.pack import Pack
from backport.vocab import GateVerdict, TreeVerdict

PASS, WARN, UNKNOWN, FAIL = GateVerdict.PASS, GateVerdict.WARN, GateVerdict.UNKNOWN, GateVerdict.FAIL
_RANK = {PASS: 0, WARN: 1, UNKNOWN: 2, FAIL: 3}
NOT_PROVEN = ("HTTP 200 and transfer-complete prove neither that the transferred KV covers what decode "
              "reserved nor that decode read only what it received")


@dataclass(frozen=True)
class ServerVerdict:
    url: str
    role: str | None
    verdict: GateVerdict
    evidence: str

    def to_json(self) -> dict:
        return {"url": self.url, "role": self.role, "verdict": self.verdict, "evidence": self.evidence}


@dataclass(frozen=True)
class GateResult:
    gate: int
    name: str
    verdict: GateVerdict
    evidence: tuple[str, ...]
    servers: tuple[ServerVerdict, ...] = ()
    remedy: str | None = None
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"gate": self.gate, "name": self.name, "verdict": self.verdict,
                "evidence": list(self.evidence), "servers": [s.to_json() for s in self.servers],
                "remedy": self.remedy, "details": self.details}


def worst(verdicts) -> GateVerdict:
    return max(verdicts, key=_RANK.__getitem__, default=UNKNOWN)


def _label(s: ServerFacts) -> str:
    return f"{s.role or 'unknown-role'} {s.url}"


def _mismatch(code: CodeFacts | None, s: ServerFacts) -> str | None:
    """Why the audited code may not be what this server runs, None when it matches."""
    if code is None or s.error:
        return None
    if s.version is None:
        return (f"{_label(s)} does not report its version; the audited code ({code.version}) may not be what "
                "it runs")
    if not same_build(code.version, s.version):
        return f"{_label(s)} runs sglang {s.version}, the audited code is {code.version}"
    return None


# ---- gate 1 -----------------------------------------------------------------------------------


def _pool_versus_context(s: ServerFacts) -> ServerVerdict:
    if s.error:
        return ServerVerdict(s.url, None, UNKNOWN, f"not read: {s.error}")
    if s.role is None:
        return ServerVerdict(s.url, None, UNKNOWN, "disaggregation_mode not reported; role unknown")
    if s.pool_tokens is None or s.context_length is None:
        reasons = [p for p in s.problems if p.split(":")[0] in ("max_total_num_tokens", "context_length")]
        return ServerVerdict(s.url, s.role, UNKNOWN, "; ".join(reasons) or "pool or context not reported")
    pool, context = s.pool_tokens, s.context_length
    numbers = f"KV pool max_total_num_tokens {pool:,} against context_length {context:,} ({s.context_source})"
    if pool >= context:
        return ServerVerdict(s.url, s.role, PASS, f"{numbers}: the pool holds the whole context")
    if s.role not in PD_ROLES:
        return ServerVerdict(s.url, s.role, WARN, f"{numbers}: pool smaller than the context on a non-PD "
                             "node (mode null); unfit to join a PD pair")
    return ServerVerdict(
        s.url,
        s.role,
        FAIL,
        f"{numbers}: a prompt of {pool + 1:,} to {context:,} tokens is "
        f"within the advertised context but does not fit the {s.role} pool; it is "
        "rejected inside the scheduler, after admission, which is the incident's configuration",
    )


def gate_pool_versus_context(servers: tuple[ServerFacts, ...]) -> GateResult:
    """Gate 1: on every prefill and decode node, the KV pool holds the configured context."""
    name = "pool versus context"
    if not servers:
        return GateResult(1, name, UNKNOWN, (("no --server given: the pool and context are read from each "
                                             "server's /server_info"),))
    per_server = tuple(_pool_versus_context(s) for s in servers)
    evidence = [f"{v.verdict}: {v.role or 'unknown-role'} {v.url}: {v.evidence}" for v in per_server]
    evidence.append("recheck after any change of weights, quantisation, parallelism or memory fraction: "
                    "the pool is measured at start-up")
    return GateResult(1, name, worst(v.verdict for v in per_server), tuple(evidence), per_server,
                      details={"servers": [s.to_json() for s in servers]})


# ---- gate 2 -----------------------------------------------------------------------------------


def remedy(code: CodeFacts, pack: Pack, missing: list[str]) -> str:
    """What to run for the missing fixes on this code's release."""
    version = code.version
    names = ", ".join(f"#{pack.fixes[f].pr}" for f in missing)
    if version is None:
        return f"the release of this code is unknown; upgrade to SGLang 0.5.22 or later for {names}"
    shipped = [f for f in missing if pack.fixes[f].is_fixed_in(version)]
    if shipped:
        return (f"sglang {version} ships {', '.join('#' + str(pack.fixes[f].pr) for f in shipped)} upstream "
                "but this code lacks it: reinstall the release, or upgrade to SGLang 0.5.22 or later")
    unpatchable = [f for f in missing if pack.variant_for(f, version) is None]
    if unpatchable:
        return (
            f"this pack carries no backport of {', '.join('#' + str(pack.fixes[f].pr) for f in unpatchable)} "
            f"for sglang {version}: upgrade to SGLang 0.5.22 or later"
        )
    return (
        f"this pack backports {names} to sglang {version}: `sglang-backport run sglang=={version} --export` "
        "fetches, patches and proves it and puts the patched wheel in the evidence bundle (export/); install "
        "it with `pip install --no-deps` on every prefill node first, then on every decode node (README, "
        "Rollout and rollback)"
    )


def _fixes_evidence(code: CodeFacts, pack: Pack, fixes) -> tuple[list[str], list[str]]:
    lines, missing = [], []
    for fid in fixes:
        found = code.detection(fid)
        if found is None:
            continue
        fix = pack.fixes[fid]
        lines.append(f"#{fix.pr} ({fix.title}): {'present' if found.present else 'MISSING'}; {found.how}")
        if not found.present:
            missing.append(fid)
    return lines, missing


def _probe_evidence(code: CodeFacts) -> tuple[list[str], GateVerdict]:
    """(lines, worst verdict the probes allow): unsafe or error cases fail; an incident case
    that could not run leaves the gate unknown."""
    from backport.expectations import outside_release  # reads the probes' registry: only when probes ran

    if code.probes is None:
        return [f"the admission and prefill-retirement probes did not run: {code.probe_error}"], UNKNOWN
    cases = [c for c in code.probes.get("cases", []) if c.get("probe") in ADMISSION_PROBES]
    if not cases:
        return ["the probe harness reported no admission or prefill-retirement case"], UNKNOWN
    lines, verdict = [f"probes run by {code.harness}"], PASS
    for probe in ADMISSION_PROBES:
        mine = [c for c in cases if c["probe"] == probe]
        counts = {
            v: sum(c["verdict"] == v for c in mine) for v in TreeVerdict
        }
        lines.append(f"probe {probe}: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n))
        for c in mine:
            if c["verdict"] in (TreeVerdict.UNSAFE, TreeVerdict.ERROR):
                verdict = FAIL
                lines.append(f"  {c['verdict']}: {probe}/{c['case']}: {c['observed']}")
            elif c["verdict"] == TreeVerdict.NOT_APPLICABLE and not c["must_preserve"]:
                if outside_release(f"{probe}/{c['case']}", code.version):
                    continue  # the case's code is another release range's (its `needs`), not missing here
                verdict = worst((verdict, UNKNOWN))
                lines.append(f"  not run: {probe}/{c['case']}: {c['observed']}")
    return lines, verdict


def gate_rejection_at_admission(code: CodeFacts | None, pack: Pack,
                                servers: tuple[ServerFacts, ...] = ()) -> GateResult:
    """Gate 2: the code retires a rejected request at the PD doors (#38935) and retires an
    aborted prefill result (#36988), by fingerprint and by the probes."""
    name = "rejection at admission"
    if code is None:
        seen = sorted({s.version for s in servers if s.version})
        hint = f" (the servers report sglang {', '.join(seen)})" if seen else ""
        return GateResult(2, name, UNKNOWN, ((f"no code given{hint}: pass --python EXE of the serving "
                                             "environment, or the TREE it was installed from"),))
    lines, missing = _fixes_evidence(code, pack, ADMISSION_FIXES)
    probe_lines, probe_verdict = _probe_evidence(code)
    mismatches = [m for m in (_mismatch(code, s) for s in servers if s.is_pd) if m]
    verdict = FAIL if missing else probe_verdict
    if mismatches:
        verdict = worst((verdict, UNKNOWN))
    evidence = [f"code: {code.how}, sglang {code.version}", *lines, *probe_lines, *mismatches]
    fix_remedy = remedy(code, pack, missing) if missing else None
    if fix_remedy:
        evidence.append(fix_remedy)
    return GateResult(2, name, verdict, tuple(evidence), remedy=fix_remedy,
                      details={"missing": missing, "code": code.to_json()})


# ---- gate 3 -----------------------------------------------------------------------------------


def _checksum_state(s: ServerFacts) -> tuple[str, str]:
    """(on | off | absent | unknown: the flag's state, not a verdict; evidence)."""
    if s.error:
        return UNKNOWN, f"not read: {s.error}"
    if s.kv_checksum is True:
        return "on", f"{CHECKSUM_FLAG} true"
    if s.kv_checksum is False:
        return "off", f"{CHECKSUM_FLAG} false"
    if s.is_server_args_dump:
        return "absent", f"this release has no --disaggregation-enable-kv-checksum (sglang {s.version})"
    return UNKNOWN, f"{CHECKSUM_FLAG} not reported and the document is not a full server-arguments dump"


def _pack_coverage(code: CodeFacts | None, pd: list[ServerFacts]) -> tuple[GateVerdict, str]:
    """(verdict, evidence) for this pack's own coverage check (prefill records how far the KV it
    wrote reaches, decode refuses a handoff short of its reservation)."""
    found = code.detection(COVERAGE_FIX) if code else None
    if code is None or found is None or not found.present:
        return WARN, ("this pack's transferred-coverage check (sglang-backport's sbp-transfer-coverage) is "
                      + ("not in the audited code" if code else "not examined (no code given)"))
    setting = code.coverage_check
    if setting is None or setting.value is not True:
        state = "OFF" if setting and setting.value is False else "in an unknown state"
        return WARN, (f"this pack's transferred-coverage check is in the code but {state} "
                      f"({setting.name + ', ' + setting.source if setting else 'its switch was not found'})")
    roles = {s.role for s in pd if s.role}
    mismatches = [m for m in (_mismatch(code, s) for s in pd) if m]
    if not set(PD_ROLES) <= roles or mismatches:
        return UNKNOWN, (
            "this pack's transferred-coverage check is on in the code, but "
            + ("; ".join(mismatches) or "both prefill and decode must run it: give both --server")
        )
    return PASS, (
        f"this pack's transferred-coverage check is on ({setting.name}, {setting.source}); prefill and "
        "decode run the audited code; it counts coverage at the handoff and cannot see a write that "
        "lands after the check"
    )


def gate_transfer_covers_read(servers: tuple[ServerFacts, ...], code: CodeFacts | None) -> GateResult:
    """Gate 3: a check that transferred KV covers what decode reserved is on, on both sides:
    upstream's handoff checksum, or this pack's own coverage check."""
    name = "transfer covers read"
    pd = [s for s in servers if s.is_pd or s.error]
    coverage_verdict, coverage = _pack_coverage(code, pd)
    result = _checksum_gate(servers, code, pd, coverage)
    if coverage_verdict == PASS and result.verdict != FAIL:
        others = tuple(e for e in result.evidence if e not in (coverage, NOT_PROVEN))
        return GateResult(3, name, PASS, (coverage, *others), result.servers)
    if coverage_verdict == UNKNOWN and result.verdict == WARN:
        return GateResult(3, name, UNKNOWN, result.evidence, result.servers)
    return result


def _checksum_gate(servers: tuple[ServerFacts, ...], code: CodeFacts | None, pd: list[ServerFacts],
                   coverage: str) -> GateResult:
    """Gate 3 by upstream's handoff checksum alone."""
    name = "transfer covers read"
    if not pd:
        if code is None:
            return GateResult(3, name, UNKNOWN, ("no --server and no code given",))
        if code.has_checksum_flag:
            return GateResult(
                3,
                name,
                UNKNOWN,
                (
                    (
                        "this code has --disaggregation-enable-kv-checksum; whether "
                        "it is on for prefill and decode needs --server"
                    ),
                ),
            )
        return GateResult(
            3,
            name,
            WARN,
            (
                (
                    f"this code (sglang {code.version}) has no handoff checksum "
                    f"(--disaggregation-enable-kv-checksum ships from 0.5.21); {coverage}"
                ),
                NOT_PROVEN,
            ),
        )
    states = [(s, *_checksum_state(s)) for s in pd]
    on = {s.role for s, st, _ in states if st == "on"}
    per_server = []
    for s, state, why in states:
        if state == "on":
            per_server.append(ServerVerdict(s.url, s.role, PASS, why))
        elif state == UNKNOWN:
            per_server.append(ServerVerdict(s.url, s.role, UNKNOWN, why))
        elif on:
            per_server.append(
                ServerVerdict(
                    s.url,
                    s.role,
                    FAIL,
                    f"{why} while it is on for another node: decode "
                    "skips the comparison when prefill wrote no checksum, so one side "
                    "alone passes silently",
                )
            )
        else:
            per_server.append(ServerVerdict(s.url, s.role, WARN, why))
    evidence = [f"{v.verdict}: {v.role or 'unknown-role'} {v.url}: {v.evidence}" for v in per_server]
    verdict = worst(v.verdict for v in per_server)
    roles = {s.role for s in pd if s.role}
    if verdict == PASS:
        if not set(PD_ROLES) <= roles:
            verdict = UNKNOWN
            evidence.append(f"only {', '.join(sorted(roles))} given: the checksum must be on for prefill "
                            "and decode both")
        evidence.append("the handoff checksum does not cover every model architecture (GLM-5.3 was among "
                        "those not covered): confirm it covers yours")
    else:
        evidence += ["upstream's handoff checksum is not on for every prefill and decode node", coverage,
                     NOT_PROVEN]
    return GateResult(3, name, verdict, tuple(evidence), tuple(per_server))


# ---- gate 4 -----------------------------------------------------------------------------------


def gate_page_lifetime(code: CodeFacts | None, pack: Pack, servers: tuple[ServerFacts, ...]) -> GateResult:
    """Gate 4: pages are held until in-flight writes drained: the fixes present, deferred release
    on, a backend with the capability, a sane timeout, on both sides of the pair."""
    name = "page lifetime"
    pd = [s for s in servers if s.is_pd or s.error]
    if code is None:
        return GateResult(
            4,
            name,
            UNKNOWN,
            (
                (
                    "no code given: the page-lifetime fixes and the deferred-release "
                    "default are read from the code (--python EXE or TREE)"
                ),
            ),
        )
    lines, missing = _fixes_evidence(code, pack, PAGE_LIFETIME_FIXES)
    verdicts = [FAIL if missing else PASS]
    deferred, timeout = code.deferred_release, code.timeout
    if deferred.value is True:
        lines.append(f"deferred decode KV release on: {deferred.name} ({deferred.source}); the servers' own "
                     "environment is not reported by /server_info: check that none sets it to 0")
    else:
        verdicts.append(FAIL if deferred.value is False else UNKNOWN)
        lines.append(f"deferred decode KV release {'OFF' if deferred.value is False else 'unknown'}: "
                     f"{deferred.name} ({deferred.source}); pages are released at once on a failed transfer")
    if timeout.value is None:
        verdicts.append(UNKNOWN)
        lines.append(f"release timeout unknown: {timeout.name} ({timeout.source})")
    else:
        if timeout.value <= 0:
            verdicts.append(WARN)
        lines.append(f"release timeout {timeout.value:g} s ({timeout.name}, {timeout.source}); a release on "
                     "timeout alone does not prove the writes stopped: size it above the worst-case drain "
                     "of one transfer chunk and treat every 'Deferred KV release ... timed out' warning as a "
                     "possible exposure")
    if code.extra.get("mooncake_tcp_proto") == "1":
        verdicts.append(FAIL)
        lines.append(
            f"{MOONCAKE_TCP_PROTO}=1 in the audit's environment: Mooncake's legacy TCP completion reports "
            "a transfer complete once its bytes left prefill's socket buffer, so the drain ACK can come "
            "before the writes land (the live tier's page-lifetime race: patched 0.5.19 and upstream "
            f"0.5.22 both unsafe 3 of 3); unset {MOONCAKE_TCP_PROTO} on every prefill and decode node"
        )
    capable = code.capable_backends
    lines.append("backends with the capability in this code: " + (
        ", ".join(capable) if capable else "none" if capable is not None
        else "none (no supports_deferred_decode_kv_release in this code)"))
    per_server = []
    for s in pd:
        if s.error:
            per_server.append(ServerVerdict(s.url, None, UNKNOWN, f"not read: {s.error}"))
        elif s.backend is None:
            per_server.append(
                ServerVerdict(s.url, s.role, UNKNOWN, "disaggregation_transfer_backend not reported")
            )
        elif capable is None or s.backend not in capable:
            per_server.append(
                ServerVerdict(
                    s.url,
                    s.role,
                    FAIL,
                    f"backend {s.backend} has no deferred-release "
                    "capability in this code: its pages are released at once",
                )
            )
        elif (why := _mismatch(code, s)) is not None:
            per_server.append(ServerVerdict(s.url, s.role, UNKNOWN, why))
        else:
            per_server.append(
                ServerVerdict(s.url, s.role, PASS, f"backend {s.backend} holds pages until drained")
            )
    lines += [f"{v.verdict}: {v.role or 'unknown-role'} {v.url}: {v.evidence}" for v in per_server]
    verdicts += [v.verdict for v in per_server]
    roles = {s.role for s in pd if s.role}
    if not pd:
        verdicts.append(UNKNOWN)
        lines.append(
            "no prefill or decode --server given: the backend and both sides of the pair are unchecked"
        )
    elif not set(PD_ROLES) <= roles:
        verdicts.append(UNKNOWN)
        lines.append(
            f"only {', '.join(sorted(roles)) or 'no'} side given: an unpatched prefill sends no drain "
            "ACK, so both sides must be checked"
        )
    fix_remedy = remedy(code, pack, missing) if missing else None
    if fix_remedy:
        lines.append(fix_remedy)
    return GateResult(4, name, worst(verdicts), (f"code: {code.how}, sglang {code.version}", *lines),
                      tuple(per_server), remedy=fix_remedy, details={"missing": missing})


def evaluate(code: CodeFacts | None, servers: tuple[ServerFacts, ...], pack: Pack) -> tuple[GateResult, ...]:
    return (gate_pool_versus_context(servers), gate_rejection_at_admission(code, pack, servers),
            gate_transfer_covers_read(servers, code), gate_page_lifetime(code, pack, servers))
