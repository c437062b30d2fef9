"""Retiring aborted disaggregated prefill results (#36988, incident steps 3-4).

Before #36988, ``process_batch_result_disagg_prefill`` dropped aborted middle
chunks but did not check the final result of an aborted request: it appended
the sampled token, cached the prefix as unfinished
(``maybe_cache_unfinished_req``), queued the request for transfer and sent the
last KV chunk. After #36988 an aborted request is retired once its last
in-flight result is safe to consume (``_retire_aborted_prefill_result``): the
sender is aborted (an exception there must not skip local cleanup), the
metadata buffer is freed, ``release_kv_cache(..., is_insert=False)`` runs once
(``checkpoint=False`` from 0.5.22), and the abort is streamed once; a delayed
result for a request already retired elsewhere is ignored.

How it is driven: the tree's real ``process_batch_result_disagg_prefill``
(and, through it, ``_retire_aborted_prefill_result`` where present, and
``handle_bootstrap_failure``) runs on a scheduler shell, with a real
``GenerationBatchResult`` and real ``Req`` objects. Stand-ins: the KV sender
(RecordingKVSender), the metadata allocator, the page pool
(CountingTokenToKVPoolAllocator, fed back by the ``release_kv_cache`` recorder), the
radix cache (RecordingRadixCache plus recorders for the module's
``maybe_cache_unfinished_req``/``checkpoint_kv_cache``), ``send_kv_chunk``
(which would gather GPU page indices), the output streamer, and a grammar
object that rejects the sampled token. ``grammar_rejected_result_sends_no_kv``
is not applicable where the final-result path never asks a grammar;
``pending_bootstrap_middle_chunk_requeued`` before 0.5.13 (no optimistic
prefill); ``sender_abort_failure_does_not_skip_cleanup`` before 0.4.9.post5,
where no KV sender has ``abort()`` (nor has the stand-in there).
"""

from __future__ import annotations

import importlib

# The scenario modules, in the order their cases run and are listed (each registers its cases on import).
SCENARIOS = ("aborted_final", "middle_chunks", "finished_results", "requeue_and_repeat")

for _scenario in SCENARIOS:
    importlib.import_module(f"{__name__}.{_scenario}")
