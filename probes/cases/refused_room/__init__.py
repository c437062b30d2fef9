"""A request prefill's door refuses releases decode's reservation (sbp-refused-room, sbp-refused-hold;
issue 41).

On 0.4.5.post1 - 0.4.9 #38935's prefill door retires an intake rejection before a KV sender
exists, while decode, whose own intake let the prompt through, creates a receiver, reserves
pages for the whole prompt and registers them with prefill. Nothing tells decode that no
transfer will come: these releases have no decode waiting timeout and decode's
``abort_request`` cannot reach the transfer queue, so the reservation is held forever and a
few such requests exhaust decode. The fix: prefill's ``MooncakeKVManager`` reports the
refused room to every decode rank that registered for it (before or after the refusal), and
decode takes that report as a final ``Failed`` its transfer queue releases at once (safe: no
sender exists for the room, so no write can land in its pages).

How the sides are driven: the tree's real ``MooncakeKVManager`` constructor in prefill and
in decode mode, its real bootstrap, transfer and decode thread bodies (captured, then run in
this thread over the messages the case delivers), the real prefill door
(``PrefillBootstrapQueue.add``), the real ``MooncakeKVReceiver.poll`` and the real
``DecodeTransferQueue.pop_transferred``. Stand-ins: the Mooncake transfer engine, the ZMQ
sockets (prefill's pushes to decode are recorded and handed to decode's thread), the
bootstrap server's HTTP registration, the page pool and metadata allocator, and the TP
all-reduce of the polls (one rank: the polls themselves).

Two manager layouts: the closure transfer thread of 0.4.5.post1 - 0.4.6.post5, and from 0.4.7
prefill's transfer queue sharded over ``transfer_worker`` methods (each worker's queue is a
``Feed``; the case runs every worker); from 0.4.8.post1 a status message carries the prefill
rank as a third frame (the case sends every status through the tree's own
``sync_status_to_decode_endpoint``). Applicability is read from the code, never from the
release number alone, so a not-applicable verdict cannot hide the exposure: the cases are not
applicable where decode has its own waiting timeout (from 0.4.9.post1:
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 300 s), which fails a room no status reaches and
releases its pages as 0.5.22 does, or where the Mooncake manager has neither layout.

From 0.4.10 to 0.5.12.post1 the pack's ``sbp-abort-hold`` keeps a failed transfer's pages until every
prefill rank's last word or the deferred-release timeout; a refused room has no sender, so its
reservation waited for the timeout (30 s) after the router's abort. ``sbp-refused-hold`` carries the
report there and decode counts it as the rank's last word: ``hold`` judges it end to end, real
prefill manager (probes/rigs/mooncake_prefill.py), real door, real decode manager and transfer queue.

Layout: ``no_timeout`` (releases whose decode has no waiting timeout, 0.4.5.post1 - 0.4.9),
``no_failure_branch`` (0.4.5.post1 - 0.4.6.post4, whose decode had no failure branch: the pack's
release is for a refused room only, on every decode rank together), ``twin`` (the same releases:
prefill's twin of a request decode's door refused, ``sbp-twin-timeout``) and ``hold`` (releases
with the pack's hold), imported below in this order.
"""

import importlib

# The scenario modules, in the order their cases run and are listed (each registers its cases on import).
SCENARIOS = ("no_timeout", "no_failure_branch", "twin", "hold")

for _scenario in SCENARIOS:
    importlib.import_module(f"{__name__}.{_scenario}")
