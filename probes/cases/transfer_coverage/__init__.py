"""The transferred-coverage check (this pack's own fix ``sbp-transfer-coverage``;
design reference #38704; incident gate 3, "transfer covers read").

Decode attends over exactly the tokens it reserved, so the KV written for a
request must cover all of them. The check: prefill records, with the last
chunk's metadata, how far the KV it wrote reaches; decode's metadata gate
refuses a request whose recorded coverage is short of its reservation (or
missing: an unpatched peer) before the polls' MIN all-reduce, so every
attention-TP rank refuses it together; the refusal is a 500, the pages are
released, a counter and a log line say so.

How it is driven: prefill's real ``send_kv_chunk`` (each chunk, with the
tree's ``MetadataBuffers`` on CPU) and decode's real ``DecodeTransferQueue``
(its constructor, ``pop_transferred``, ``_poll_with_metadata_gate`` and
``_commit_transfer_to_req``), on one rank or two. Stand-ins: the RDMA write
of the metadata row (a row copy between the two ``MetadataBuffers``), the KV
page write itself (nothing to check on a CPU: the pages are counted), the
transport poll (``KVPoll.Success``: the transfer completed), the gloo
all-reduce (two threads meeting at a barrier take the MIN), decode's
preallocation (the reservation is the tree's own ``_pre_alloc_fill_len``,
recorded in ``kv_committed_len`` as ``_pre_alloc`` does), the page pools
(CountingTokenToKVPoolAllocator) and the output streamer. The rig: probes/rigs/coverage.py and
probes/rigs/host_memory.py.

The refusal cases are unsafe on every release without the fix (a short
handoff is committed and decoded: HTTP 200 over stale pages). The
must-preserve cases are the legitimate handoffs #38704 names: a cached
prefix (prefill's prefix cache and decode's own), chunked prefill, a
rebootstrap with output tokens, a retracted request, a speculative (EAGLE)
handoff with its draft metadata, and attention-TP ranks committing together.
"""

from __future__ import annotations

import importlib

# The scenario modules, in the order their cases run and are listed (each registers its cases on import).
SCENARIOS = ("handoff_commit", "host_staged")

for _scenario in SCENARIOS:
    importlib.import_module(f"{__name__}.{_scenario}")
