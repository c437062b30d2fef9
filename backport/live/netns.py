"""A private network namespace for one deployment, and the tc shaping of one Mooncake flow in it.

The calling thread enters a fresh network namespace (unshare(CLONE_NEWNET)) and leaves it on
exit; every process and thread started inside inherits it, so the whole deployment, its client
and its shaping live on a loopback of their own: no other helper's traffic is shaped, and the
namespace disappears with its last process (a SIGKILLed run leaves no named namespace behind).

Loopback gets MTU 1500: with its default 64 KiB MTU an htb-shaped TCP flow stalls (measured, issue
42). One htb class slows only the packets to decode's Mooncake data port whose source port is in
an aligned block (the A-prefill's connections, opened while `ip_local_port_range` was that block).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
# A's source ports: an aligned block, so one u32 mask matches it; everything else uses OTHER_RANGE
A_PORTS = (40960, 41983)        # 0xa000 - 0xa3ff
A_PORT_MASK = 0xFC00
# below 55536: 0.5.13 derives a gRPC port as --port + 10000 and refuses one above 65535
OTHER_RANGE = (42000, 55499)
SHAPED_CLASS = "1:10"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unavailable() -> str | None:
    """Why a shaped private namespace cannot be made here (None when it can): tried, not guessed."""
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (Debian's iproute2)"
    try:
        with private_namespace():
            run(["tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb"])
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
        return f"no private network namespace with htb shaping here: {detail[:200]}"
    return None


def run(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


@contextlib.contextmanager
def private_namespace() -> Iterator[None]:
    """The calling thread in a new network namespace (lo up, MTU 1500) until the block ends."""
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        try:
            run(["ip", "link", "set", "lo", "mtu", "1500", "up"])
            yield
        finally:
            _check(_libc.setns(original, CLONE_NEWNET), "setns back to the original namespace")
    finally:
        os.close(original)


def set_port_range(low: int, high: int) -> None:
    # a child reads /proc/sys/net of its own namespace: the thread's, inherited
    run(["sh", "-c", f"echo '{low} {high}' > /proc/sys/net/ipv4/ip_local_port_range"])


def set_send_buffer(size: int) -> None:
    """TCP send buffers of this namespace up to `size` bytes (the MC_TCP_PROTO=1 variant: more
    of a transfer counted "complete" while it still sits on prefill's side)."""
    run(["sh", "-c", f"echo '4096 {size} {size}' > /proc/sys/net/ipv4/tcp_wmem"])


@dataclass(frozen=True)
class Shaping:
    data_port: int      # decode's Mooncake data port
    rate: str           # e.g. "3mbit"

    def commands(self) -> list[list[str]]:
        """htb root (unclassified traffic passes unshaped), one class, one u32 filter."""
        return [["tc", "qdisc", "replace", "dev", "lo", "root", "handle", "1:", "htb"],
                ["tc", "class", "replace", "dev", "lo", "parent", "1:", "classid", SHAPED_CLASS, "htb",
                 "rate", self.rate, "ceil", self.rate],
                ["tc", "filter", "replace", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "ip", "dport", str(self.data_port), "0xffff",
                 "match", "ip", "sport", str(A_PORTS[0]), hex(A_PORT_MASK), "flowid", SHAPED_CLASS]]

    def apply(self) -> None:
        for argv in self.commands():
            run(argv)

    def set_rate(self, rate: str) -> None:
        run(["tc", "class", "change", "dev", "lo", "parent", "1:", "classid", SHAPED_CLASS, "htb",
             "rate", rate, "ceil", rate])


def shaped_bytes() -> int:
    """Bytes the shaped class has sent so far (tc's counter)."""
    return parse_class_bytes(run(["tc", "-s", "class", "show", "dev", "lo", "classid", SHAPED_CLASS]))


def parse_class_bytes(text: str) -> int:
    found = re.search(r"Sent (\d+) bytes", text)
    if found is None:
        raise ValueError(f"no byte counter in tc's output: {text[:200]!r}")
    return int(found.group(1))


def busiest_connection(ss_output: str, sport_range: tuple[int, int]) -> tuple[int, int] | None:
    """(destination port, bytes acked) of the established connection from a source port in
    `sport_range` that carried the most bytes, from `ss -tni` output; None when there is none."""
    best = None
    current = None
    for line in ss_output.splitlines():
        cols = line.split()
        if len(cols) >= 5 and cols[0] == "ESTAB":
            local, peer = cols[3], cols[4]
            sport, dport = int(local.rsplit(":", 1)[1]), int(peer.rsplit(":", 1)[1])
            current = dport if sport_range[0] <= sport <= sport_range[1] else None
            continue
        acked = re.search(r"bytes_acked:(\d+)", line)
        if current is not None and acked:
            sent = int(acked.group(1))
            if best is None or sent > best[1]:
                best = (current, sent)
            current = None
    return best


def data_port_from_a() -> tuple[int, int] | None:
    return busiest_connection(run(["ss", "-tni"]), A_PORTS)
