"""Decode page lifetime after a failed transfer (#35049, #37454, #40645, #41023,
#41402, #41404; incident gate 4).

A transfer that fails on the decode side may still have RDMA writes from
prefill ranks in flight toward the pages decode preallocated. If decode
returns those pages to the allocator at once, the next request can be given
them and have them overwritten by the late write. The fix chain holds the
pages (and the metadata slot) in ``DecodeTransferQueue._deferred_releases``
until every notified prefill rank has sent its drain ACK
(``CommonKVManager.register_deferred_abort_room`` / ``note_abort_ack`` /
``is_abort_release_safe``), then releases them exactly once. #35049 added it
behind ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` (off by default,
decode-initiated aborts only), #37454 gated it on a backend capability,
#41023 turned it on by default and #41404 holds on every failure.

All cases but two run with the release's DEFAULT environment (the variable
unset), which is what operators run; ``explicit_deferral_on_incapable_backend_is_reported``
and ``explicit_deferral_warnings_not_repeated`` set it to 1, as an operator who
asks for deferral does, and capture the decode module's warnings.

How it is driven: the tree's ``DecodeTransferQueue`` (its real constructor,
called with the parameters its release asks for), its real
``pop_transferred`` and ``resolve_deferred_releases``, and the tree's real
``CommonKVReceiver`` notification path and ``CommonKVManager`` ACK tracker on
instances built without their network constructors. Stand-ins: the transport
poll (reports ``KVPoll.Failed`` for the room, in place of the all-reduced
poll), the prefill peers' sockets (record the ABORT each rank is sent), the
drain ACKs (delivered by calling ``note_abort_ack`` as the receiver thread
would), the page pool (CountingTokenToKVPoolAllocator, fed by the ``release_kv_cache``
recorder) and the metadata allocator. ``enable_host_receive`` is forced off
(host-staged receive is a different path). The capable backend is a
``CommonKVManager`` subclass that opts in (``supports_deferred_decode_kv_release
= True``), standing for Mooncake/NIXL; its ``enable_deferred_decode_kv_release``
is computed with the constructor's own expression (the environment flag, and
the class capability where the release has one).

Absent structures, decided per case:
- ``failed_transfer_holds_pages_until_drain`` on 0.5.17/0.5.18 (no deferral
  at all) is ``unsafe``, not ``not-applicable``: the unsafe behaviour is
  observable there, the real ``pop_transferred`` returns the pages at once.
- ``ack_before_registration_not_counted`` and ``ack_after_release_not_counted``
  exercise the ACK tracker itself; where ``CommonKVManager`` has no tracker
  (0.5.17/0.5.18) there is nothing to drive: ``not-applicable``.
- ``no_capability_backend_releases_at_once`` runs everywhere (the FAKE
  backend exists in every release).
- ``explicit_deferral_on_incapable_backend_is_reported`` is ``not-applicable``
  where the release has no deferral variable (before 0.5.19). Its backend is
  a ``CommonKVManager`` without an opt-in of its own (any backend without
  the capability); Mori's own decode is judged by the ``mori_hold`` probe.
- ``waiting_timeout_holds_pages_until_drain`` runs the real
  ``CommonKVReceiver._check_waiting_timeout``; ``scheduler_abort_keeps_raced_ack``
  the real ``Scheduler.abort_request`` on a decode scheduler shell, with a
  prefill socket that answers the ABORT with its ACK at once; it is
  ``not-applicable`` where decode has no ACK tracker (before 0.5.19).

Below 0.5.13 (no decode-to-prefill ABORT, no drain ACK) the pack's own ``sbp-abort-hold`` holds a
failed transfer's pages until every prefill rank's final Success or the timeout;
``prefill_done_hold`` judges 0.4.8.post1 - 0.5.12.post1 on a real decode ``MooncakeKVManager``
(probes/rigs/mooncake_decode.py), pristine (unsafe: the pages go back at ``pop_transferred``) and
patched; on such a tree ``failed_transfer_holds_pages_until_drain`` (a prefill fault: no final
Success ever comes) expects the hold to last until the deferred-release timeout.

Layout: the rig is probes/rigs/failed_transfer.py (``TransferRig`` and the managers and receivers it
is driven with); the scenarios are one module per part, imported below in this order (the order
the cases run and are listed in): ``drain_hold`` (a failed transfer's pages held until the drain
ACKs; the ACK tracker's early and late ACKs), ``backend_capability`` (backends without the
capability, and the explicit deferral variable) and ``decode_aborts`` (the waiting timeout and
the scheduler's abort, which decode starts itself) and ``prefill_done_hold`` (this pack's hold below
0.5.13).
"""

import importlib

# The scenario modules, in the order their cases run and are listed (each registers its cases on import).
SCENARIOS = ("drain_hold", "backend_capability", "decode_aborts", "prefill_done_hold")

for _scenario in SCENARIOS:
    importlib.import_module(f"{__name__}.{_scenario}")
