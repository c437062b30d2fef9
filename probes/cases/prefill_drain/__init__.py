"""Prefill-side drain ACKs (#35049, #40645, #41402 and 0.5.22's failed-send
rule; issue 13).

Decode holds a failed request's pages until every prefill rank ACKs that its
writes into them drained. The ACK comes from the prefill: the Mooncake
transfer worker counts a room's chunks in flight (``_staging_outstanding``)
and ``CommonKVManager._maybe_ack_drained_abort`` sends the ACK once the count
is zero to every decode endpoint that sent an ABORT. A send that fails on the
transfer engine's wall-clock timeout leaves the batch still writing while the
worker decrements the count, so an ACK sent then lets decode free pages a
write can still land on. 0.5.22 withholds the ACK for such a room for good
(``poison_deferred_ack_room``, ``_poison_unsettled_send``); decode falls back
to its release timeout.

How it is driven: the tree's real ``MooncakeKVManager.transfer_worker`` (its
failure branches, the outstanding count, the drain ACK), the real ABORT
handler (the bootstrap thread's loop body, run in the probe's thread; the
``_handle_abort_notification`` method from 0.5.22), the real
``CommonKVManager`` ACK registry and the real ``CommonKVSender.clear``, on a
manager built without its network constructor. Stand-ins: the transfer
engine under ``send_kvcache``/``send_aux`` (``TransferEngineStandIn``: writes
complete, time out while still running, are held in flight, or crash the
worker), the ZMQ pushes to decode (``DecodePeerWire``), the server socket the
ABORTs arrive on, the DSA/CP layout decision (no skipping). Two decode
ranks share the room (decode TP 2 against prefill TP 1), each with its own
endpoint, as in #41402.

These cases run with ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``
on (the default from 0.5.21 and in the patched trees; an opt-in on 0.5.19 and
0.5.20) except ``without_capability_keeps_immediate_ack``, which turns it off
as a backend without the capability has it. On 0.5.17/0.5.18 the prefill has
no drain-ACK accounting (no #35049): those cases are ``not-applicable``.

NIXL (``nixl_failed_handle_withholds_ack``): the tree's real
``NixlKVManager.transfer_worker`` and ABORT handler on a manager built without
its constructor (probes/rigs/nixl.py; the ``nixl`` package is never imported),
with a NIXL agent stand-in whose handles are DONE, ERR, still running, or
unreadable (a state read that raises while the write runs).
``failed_aux_or_state_send_withholds_ack`` fails the last chunk's aux or state
write instead of the KV write. Not driven here: Ascend's own
``send_kvcache``; it reaches the drain ACK through this very worker.

Terminal Failed (0.5.20's ``update_status``): ``aborted_room_stays_failed_on_late_bootstrap``
delivers a late decode rank's transfer info through the real bootstrap thread
after another rank's ABORT, then offers the room's chunk through the real
``add_transfer_request``; ``nixl_aborted_room_stays_failed_after_inflight_chunk``
lets a non-last NIXL chunk land after the ABORT. The per-layer wait
(``per_layer_send_reports_failure_after_every_write``) runs the real
``send_kvcache`` on a real thread pool over ``PerLayerEngineStandIn``; it needs
no drain accounting, so it runs from 0.4.6 (0.4.5.x writes the layers one
after another: not-applicable).

The registry as the constructor sets it up (issue 14): the ``constructed_*`` cases and
``cleared_sender_drops_target_without_drain_accounting`` build the tree's ``CommonKVManager``
through its real ``__init__`` (probes/rigs/manager.py: a real ZMQ socket on localhost; the
bootstrap-port sync, the bootstrap registration and the PP group stood in for).

Layout: one module per part of the story, imported below in this order (the order the cases run
and are listed in): ``drain_ack`` (when the transfer worker's drain ACK leaves: Mooncake and the
NIXL failed handle), ``terminal_failed`` (an ABORTed room stays Failed), ``per_layer_send`` (the
Mooncake per-layer wait), ``constructed_manager`` (the registry ``__init__`` sets up) and
``reference_parity`` (0.5.22's standard where the pack's backport differed, issue 26) and
``send_lock`` (the drain ACK under its decode endpoint's send lock, issue 41). The rigs
are probes/rigs/mooncake.py, probes/rigs/nixl.py and probes/rigs/manager.py.
"""

import importlib

# The scenario modules, in the order their cases run and are listed (each registers its cases on import).
SCENARIOS = ("drain_ack", "terminal_failed", "per_layer_send", "constructed_manager", "reference_parity",
             "send_lock")

for _scenario in SCENARIOS:
    importlib.import_module(f"{__name__}.{_scenario}")
