"""Backends without the drain-ACK capability (#37454) and the explicit deferral variable
(#41023): released at once, exactly once, or held as asked; warnings said once. The probe:
probes/cases/page_lifetime/.
"""

from __future__ import annotations

from ... import SAFE, UNSAFE, NotApplicable, Outcome, case, judged
from ...rigs.failed_transfer import (
    DEFERRED_ENV,
    TransferRig,
    WarningRecorder,
    decode_log,
    drain_acking_manager,
    drain_acking_receiver,
    failure_stops_decode,
    fake_receiver,
    no_capability_manager,
)
from ...standins import sg_attr


@case(
    # up to 0.4.6.post4 decode has no failed-transfer path (pop_transferred raises "Transfer failed")
    needs=(">=0.4.6.post5",),
    must_preserve=True,
    expect="A backend without the drain-ACK capability releases a failed transfer's pages at once, exactly "
           "once.",
)
def no_capability_backend_releases_at_once(ctx) -> Outcome:
    """#37454 must-preserve: a backend without the drain-ACK capability
    (FAKE) releases a failed transfer's pages at once, exactly once, and
    holds nothing."""
    if failure_stops_decode():
        raise NotApplicable("decode has no failed-transfer path: a transfer's own Failed raises")
    rig = TransferRig(ctx)
    rcv = fake_receiver(504)
    req = rig.enqueue(rcv, "fake-failed", 504)
    rig.queue.pop_transferred()
    after_pop = rig.snapshot(req)
    rig.resolve()
    after_resolve = rig.snapshot(req)
    details = {
        "after_pop_transferred": after_pop,
        "after_resolve": after_resolve,
        "double_releases": rig.ledger.count("pages_double_release"),
    }
    ok = (
        after_pop["pages_held"] == 0
        and after_pop["release_calls"] == 1
        and after_pop["metadata_frees"] == 1
        and after_pop["deferred_entries"] == 0
        and after_resolve["release_calls"] == 1
        and not details["double_releases"]
    )
    if ok:
        return Outcome(
            SAFE, "The FAKE backend's failed transfer was released at once, exactly once.", details
        )
    return Outcome(
        UNSAFE, "The FAKE backend's failed transfer was not released at once exactly once.", details
    )


@case(
    needs=("pr35049",),
    must_preserve=True,
    expect="With SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 set, a transfer decode aborted on a "
           "backend without the drain-ACK capability either keeps its pages held (the deferral asked for) or "
           "releases them exactly once; whether a warning named the variable is reported.",
)
def explicit_deferral_on_incapable_backend_is_reported(ctx) -> Outcome:
    """#37454/#41023 must-preserve: before the capability gate, setting the
    variable made every ``CommonKVManager`` backend (Mori too) hold a
    decode-aborted transfer's pages; after it, such a backend releases them at
    once. An operator who set the variable is then told so by a warning."""
    envs = sg_attr("environ", "envs")
    if envs is None or not hasattr(envs, DEFERRED_ENV):
        raise NotApplicable(f"no {DEFERRED_ENV} in this release (no #35049): there is no deferral to ask for")
    rig = TransferRig(ctx, deferred_env="1")
    mgr = no_capability_manager(rig.ledger)
    rcv = drain_acking_receiver(rig.ledger, mgr, room=505, prefill_ranks=1)
    req = rig.enqueue(rcv, "incapable-aborted", 505)
    rcv.abort()  # decode aborts the request mid-transfer
    with decode_log(WarningRecorder()) as recorder:
        rig.queue.pop_transferred()
    after_pop = rig.snapshot(req)
    warnings = [m for m in recorder.messages if DEFERRED_ENV in m]
    details = {
        "backend_flag": bool(mgr.enable_deferred_decode_kv_release),
        "after_pop_transferred": after_pop,
        "warnings_naming_the_variable": warnings,
        "double_releases": rig.ledger.count("pages_double_release"),
    }
    held = after_pop["pages_held"] > 0 and after_pop["deferred_entries"] == 1
    released_once = after_pop["pages_held"] == 0 and after_pop["release_calls"] == 1
    # The verdict is the pages' fate (held, or released exactly once); whether the operator was
    # told is reported, not judged: upstream 0.5.21/0.5.22 release silently, the pack warns on
    # 0.5.19/0.5.20 (tests/test_matrix.py checks the warning there).
    if held:
        return Outcome(SAFE, "The pages were held, as the variable asks.", details)
    if released_once and not details["double_releases"]:
        told = "and a warning named the variable" if warnings else "silently (no warning named the variable)"
        return Outcome(SAFE, f"The pages were released at once, exactly once, {told}.", details)
    return Outcome(UNSAFE, "The pages were neither held nor released exactly once.", details)


@case(
    needs=("pr35049",),
    must_preserve=True,
    expect="With SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 set, two aborted transfers on a backend "
           "without "
    "the drain-ACK capability, one on a backend with it, and one failed before any prefill rank learned its "
    "pages "
    "are each held or released exactly once; no warning names a backend that does defer, and no backend is "
    "warned about twice (one decode scheduler).",
)
def explicit_deferral_warnings_not_repeated(ctx) -> Outcome:
    """Must-preserve beside ``explicit_deferral_on_incapable_backend_is_reported``: the pack's warning
    (patched 0.5.19/0.5.20) is said once per backend and never for a backend that holds the pages; upstream
    says nothing, which also keeps this."""
    envs = sg_attr("environ", "envs")
    if envs is None or not hasattr(envs, DEFERRED_ENV):
        raise NotApplicable(f"no {DEFERRED_ENV} in this release (no #35049): there is no deferral to ask for")
    rig = TransferRig(ctx, deferred_env="1")
    incapable = no_capability_manager(rig.ledger)
    capable = drain_acking_manager(rig.ledger)
    transfers = []
    for mgr, room in ((incapable, 508), (incapable, 509), (capable, 510), (capable, 511)):
        rcv = drain_acking_receiver(rig.ledger, mgr, room=room, prefill_ranks=1)
        transfers.append((type(mgr).__name__, rig.enqueue(rcv, f"explicit-{room}", room)))
        if room == 511:
            # Bootstrap never completed: no prefill rank learned these pages, so there is nobody to
            # wait for and the capable backend releases at once, which is not the backend's fault.
            rcv.bootstrap_infos = None
        else:
            rcv.abort()  # decode aborts the request mid-transfer
    fates = {}
    with decode_log(WarningRecorder()) as recorder:
        for _backend, req in transfers:  # one failed transfer per scheduler step
            rig.queue.pop_transferred()
            snap = rig.snapshot(req)
            held = snap["pages_held"] > 0
            fates[req.rid] = (
                "held" if held else ("released once" if snap["release_calls"] == 1 else "neither")
            )
    warnings = [m for m in recorder.messages if DEFERRED_ENV in m]
    # in the transfers' order: a set's order follows the string hash, which differs per interpreter,
    # and this dict is printed in the observed text (the same run must give the same bytes)
    per_backend = {
        name: sum(1 for m in warnings if name in m) for name in dict.fromkeys(b for b, _ in transfers)
    }
    details = {
        "fates": fates,
        "warnings_per_backend": per_backend,
        "warnings_naming_the_variable": warnings,
        "double_releases": rig.ledger.count("pages_double_release"),
    }
    problems = [
        f"{rid}: pages neither held nor released exactly once" for rid, f in fates.items() if f == "neither"
    ]
    if details["double_releases"]:
        problems.append("pages released twice")
    if per_backend.get(type(capable).__name__):
        problems.append("a warning named a backend that defers")
    if any(n > 1 for n in per_backend.values()):
        problems.append(f"a backend was warned about more than once: {per_backend}")
    return judged(problems, (
        f"Each transfer held or released once ({fates}); warnings per backend {per_backend}."), details)
