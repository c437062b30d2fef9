"""``mori.io`` stand-in: an I/O engine without a NIC (see the package docstring)."""

from __future__ import annotations

import enum
import itertools
import json
from dataclasses import asdict, dataclass

# A real engine binds an RDMA control port; this one binds nothing and reports a distinct
# placeholder port per engine (a manager asserts the port is positive).
_PORTS = itertools.count(47000)


class BackendType(enum.Enum):
    RDMA = 1


class MemoryLocationType(enum.Enum):
    CPU = 0
    GPU = 1


class PollCqMode(enum.Enum):
    POLLING = 0
    EVENT = 1


class StatusCode(enum.IntEnum):
    SUCCESS = 0
    IN_PROGRESS = 1
    ERR_INVALID_ARGS = 2
    ERR_RDMA_OP = 3


@dataclass(frozen=True)
class IOEngineConfig:
    host: str
    port: int = 0


@dataclass(frozen=True)
class RdmaBackendConfig:
    qp_per_transfer: int
    post_batch_size: int
    num_worker_threads: int
    poll_cq_mode: PollCqMode
    enable_notification: bool


@dataclass(frozen=True)
class EngineDesc:
    """What a peer needs to reach an engine; ``pack`` is what travels in the bootstrap message."""

    key: str
    host: str
    port: int

    def pack(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def unpack(cls, blob: bytes) -> EngineDesc:
        return cls(**json.loads(blob))


@dataclass(frozen=True)
class MemoryDesc:
    """A registered buffer (address, length, device, location); nothing is pinned here."""

    engine_key: str
    address: int
    size: int
    device_id: int
    location: str

    def pack(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def unpack(cls, blob: bytes) -> MemoryDesc:
        return cls(**json.loads(blob))


def _no_nic(what: str):
    def call(self, *args, **kwargs):
        raise RuntimeError(f"mori stand-in: IOEngine.{what} called in the CPU probe environment "
                           f"(it needs an RDMA NIC)")

    call.__name__ = what
    return call


class IOEngine:
    """An engine without a NIC: construction, backend creation and local registration only."""

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        self.key = key
        self.config = config
        self.backends: dict[BackendType, RdmaBackendConfig] = {}
        self.registered: list[MemoryDesc] = []
        self._desc = EngineDesc(key, config.host, config.port or next(_PORTS))

    def create_backend(self, backend: BackendType, config: RdmaBackendConfig) -> None:
        self.backends[backend] = config

    def get_engine_desc(self) -> EngineDesc:
        return self._desc

    def register_memory(
        self, address: int, size: int, device_id: int, location: MemoryLocationType
    ) -> MemoryDesc:
        desc = MemoryDesc(self.key, int(address), int(size), int(device_id), location.name)
        self.registered.append(desc)
        return desc

    def deregister_memory(self, desc: MemoryDesc) -> None:
        self.registered = [d for d in self.registered if d != desc]

    register_remote_engine = _no_nic("register_remote_engine")
    allocate_transfer_uid = _no_nic("allocate_transfer_uid")
    batch_write = _no_nic("batch_write")
    batch_read = _no_nic("batch_read")
    write = _no_nic("write")
    read = _no_nic("read")
    wait_all = _no_nic("wait_all")
