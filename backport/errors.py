"""The two ways a command can end other than success (the CLI contract: docs/reference.md)."""


class BadInput(Exception):
    """Bad input or usage: exit 2 with one line that names the input and the problem."""


class Finding(Exception):
    """A result the operator must act on (a patch failed, a digest mismatch): exit 1."""

    # With --json, the one JSON document the main prints for it (None: the error line's own document).
    document: dict | None = None


class Interrupted(BaseException):
    """SIGTERM or SIGHUP, raised where the program is so that every `finally` runs (each process
    a command started is stopped, each temporary directory removed), as KeyboardInterrupt for SIGINT."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
