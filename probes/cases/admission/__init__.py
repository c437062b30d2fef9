"""Admission doors of PD serving (#38935, incident steps 2 and 5).

``Req.set_finish_with_abort`` records an intake rejection in ``to_finish``
and swaps the prompt for a one-token stub; ``finished()`` reads only
``finished_reason``, so before #38935 every PD admission door let the rejected
request through: prefill created a KV sender and queued it for bootstrap,
decode created a KV receiver and queued it for preallocation.
#38935 retires such a request at ``PrefillBootstrapQueue.add`` and
``DecodePreallocQueue.add`` (``is_unadmitted_reject`` +
``Scheduler.retire_unadmitted_request``): no handoff object, no queue entry,
the original 400 streamed once. Requests that re-enter a door while still
owning resources (metadata buffer, retraction backup, a retraction flag) are
not retired, and the non-PD dispatcher ``_add_request_to_queue`` stays a
pure dispatcher.

How the doors are driven: the real ``add`` of each queue class is called
unbound on an instance created without its constructor (constructors drift
between releases), carrying the attributes the door reads. The door's own
helpers (``create_sender``, ``_create_receiver_and_enqueue``, the prefill
capacity check) are the tree's. Stand-ins: the transport classes returned by
``get_kv_class`` (RecordingKVSender/RecordingKVReceiver), the metadata
allocator, the output streamer, and a scheduler shell whose retire and
dispatch methods are the tree's own. The decode door's KV capacity check is
stubbed to "fits" (in the incident decode's pool was large enough; that
check's inputs drift from release to release and are not under test), and
the DSV4/DSpark rebootstrap test is stubbed to "not that model".

Not applicable: ``prefill_door_retraction_backup_not_retired`` up to 0.5.17,
whose requests cannot hold a host retraction backup (added in 0.5.18);
``decode_door_rebootstrap_not_retired`` up to 0.5.15.post1, whose decode door
has no ``is_rebootstrap`` flag (PD rebootstrap arrives in 0.5.16);
``rejected_session_request_releases_session_and_cache`` up to 0.5.10.post1,
whose streaming sessions keep no in-flight state (the real ``Session`` from
0.5.11 stands in the case, marked in flight as ``create_req`` marks it);
``finished_abort_retired_at_doors`` up to 0.4.6.post3, whose requests carry no
``finished_output`` (nothing records that a finish went out, and no path of
those releases streams a request before its door).
"""

from __future__ import annotations

import importlib

# The scenario modules, in the order their cases run and are listed (each registers its cases on import).
SCENARIOS = ("rejected", "reentry")

for _scenario in SCENARIOS:
    importlib.import_module(f"{__name__}.{_scenario}")
