"""Stand-in for mori (AMD's RDMA I/O library) in the CPU probe environment.

SGLang's Mori backend (``sglang/srt/disaggregation/mori/conn.py``, 0.5.9 and later) imports
``mori.cpp.TransferStatus`` and ten names of ``mori.io`` at module level; the real package needs
an RDMA NIC and ROCm. Here an ``IOEngine`` is an engine without a NIC: it can be built, given its
RDMA backend and asked to register local memory (what a manager's constructor does), and every
data-path call (a remote engine, a transfer id, a write, a wait) raises, so a case that reached
one is an error, never a transfer that silently did nothing.
"""

__version__ = "0.0.0+sglang-backport-stand-in"
