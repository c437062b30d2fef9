"""``mori.cpp`` stand-in: the status handle of one RDMA transfer (only its type is imported)."""


class TransferStatus:
    """A transfer's status handle. No transfer runs here, so none is ever created."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("mori stand-in: mori.cpp.TransferStatus created in the CPU probe environment "
                           "(no RDMA transfer runs here)")
