"""The two ways a command can end other than success (DESIGN.md, CLI contract)."""


class BadInput(Exception):
    """Bad input or usage: exit 2 with one line that names the input and the problem."""


class Finding(Exception):
    """A result the operator must act on (a patch failed, a digest mismatch): exit 1."""
