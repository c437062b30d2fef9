"""Stand-ins for the KV transport as the queue doors see it: the sender and receiver classes
``get_kv_class`` returns, recording every handoff object the tree creates, and the KV manager.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from . import Ledger, has_method, sg


class _TransferFailed(Exception):
    """What a failed transport reports through ``failure_exception``."""


def tree_sender_can_abort() -> bool:
    """Whether a KV sender of the tree has ``abort()``: Mooncake's from 0.4.9.post5 (the base class
    declares it later). Before, no sender can be told of an abort, and the stand-in has none either."""
    return has_method("disaggregation.base.conn.BaseKVSender", "abort") or has_method(
        "disaggregation.mooncake.conn.MooncakeKVSender", "abort")


def recording_sender_class(ledger: Ledger, *, abort_raises: bool = False):
    """A KV sender class for ``get_kv_class(..., SENDER)``; with ``abort()`` only where the tree's
    senders have one (``tree_sender_can_abort``)."""

    class RecordingKVSender:
        """Stands for a Mooncake/NIXL sender: records that prefill created a
        handoff object for a request, the pages it announced, and aborts."""

        def __init__(self, mgr=None, bootstrap_addr=None, bootstrap_room=None, **_):
            self.kv_mgr = mgr
            self.bootstrap_room = bootstrap_room
            self.conclude_state = None
            self.num_pages: int | None = None
            ledger.record("sender_created", room=bootstrap_room)

        def init(self, num_kv_indices, aux_index=None, *args, **kwargs):
            self.num_pages = int(num_kv_indices)
            ledger.record(
                "sender_init",
                room=self.bootstrap_room,
                num_pages=int(num_kv_indices),
                metadata_index=None if aux_index is None else int(aux_index),
            )

        def pop_decode_prefix_len(self) -> int:
            return 0

        def poll(self):
            from sglang.srt.disaggregation.base import KVPoll

            return self.conclude_state or KVPoll.WaitingForInput

        def should_send_kv_chunk(self, num_pages, last_chunk) -> bool:
            return num_pages > 0 or last_chunk

        def get_max_transfer_tokens(self):
            return None  # the base sender's default (0.5.21+): no per-send limit

        def send(self, kv_indices, *args, **kwargs):
            ledger.record("sender_send", room=self.bootstrap_room, n=len(kv_indices))

        def abort(self):
            ledger.record("sender_abort", room=self.bootstrap_room)
            if abort_raises:
                raise ConnectionError("probe: transport refused the abort")

        def failure_exception(self):
            raise _TransferFailed("probe: bootstrap with decode failed")

        def clear(self):
            ledger.record("sender_clear", room=self.bootstrap_room)

        def get_transfer_metric(self):
            return None

    if not tree_sender_can_abort():  # 0.4.5.post1 - 0.4.9.post4
        del RecordingKVSender.abort
    return RecordingKVSender


def recording_receiver_class(ledger: Ledger):
    """A KV receiver class for ``get_kv_class(..., RECEIVER)``."""

    class RecordingKVReceiver:
        """Stands for a Mooncake/NIXL receiver: records that decode created a
        handoff object and bootstrapped it."""

        def __init__(self, mgr=None, bootstrap_addr=None, bootstrap_room=None, **_):
            self.kv_mgr = mgr
            self.bootstrap_room = bootstrap_room
            self.abort_notified = False
            self.require_staging = False
            self.conclude_state = None
            ledger.record("receiver_created", room=bootstrap_room)

        def init(self, prefill_dp_rank=None, *args, **kwargs):
            ledger.record("receiver_init", room=self.bootstrap_room)

        def poll(self):
            from sglang.srt.disaggregation.base import KVPoll

            return self.conclude_state or KVPoll.Bootstrapping

        def send_metadata(self, *args, **kwargs):
            ledger.record("receiver_send_metadata", room=self.bootstrap_room)

        def failure_exception(self):
            raise _TransferFailed("probe: transfer failed")

        def abort(self):
            ledger.record("receiver_abort", room=self.bootstrap_room)

        def clear(self):
            ledger.record("receiver_clear", room=self.bootstrap_room)

    return RecordingKVReceiver


class KVManagerStandIn:
    """Stands for a KV manager as the queue doors see it: no prefill peers known yet."""

    def __init__(self) -> None:
        self.prefill_info_table: dict[str, Any] = {}
        self.kv_args = SimpleNamespace(state_types=[])
        self.enable_deferred_decode_kv_release = False


def patch_transport(ctx, ledger: Ledger, *, abort_raises: bool = False) -> None:
    """Route ``get_kv_class`` of the prefill and decode modules to recording classes."""
    from sglang.srt.disaggregation.utils import KVClassType

    sender_cls = recording_sender_class(ledger, abort_raises=abort_raises)
    receiver_cls = recording_receiver_class(ledger)

    def get_kv_class(backend, class_type):
        if class_type == KVClassType.SENDER:
            return sender_cls
        if class_type == KVClassType.RECEIVER:
            return receiver_cls
        raise ValueError(f"probe transport has no {class_type}")

    for name in ("disaggregation.prefill", "disaggregation.decode"):
        ctx.patch_if_present(sg(name), "get_kv_class", get_kv_class)
