"""The bundle format: its version, which versions this toolkit reads, and who reads the others.

The bundle format is versioned apart from the toolkit: a bundle of format N is one whose
receipt says `predicate.schema_version: N`, and it is checked against the receipt schema whose
`$id` ends in `/format/N/schema.json`. The shipped schema is the one place N is written (its
`$id`, and the `schema_version` const the validator checks, which test_versions holds to it);
the receipt writer and `verify` read N from it.

The compatibility rule (docs/decisions.md): `verify` reads every format it ever wrote, or names
the toolkit that can, in one line (exit 2, as bad input: this toolkit cannot judge the bundle,
which is not the same as finding it altered). Formats 1 and 2 were written before the first
release (0.9.0); OLDER_READERS names the last commits that read them. A format newer than this
toolkit's asks for a newer toolkit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from backport import __version__, resources
from backport.errors import BadInput, Finding
from backport.evidence.layout import RECEIPT

SCHEMA_ID = re.compile(r"^https://sglang-backport\.dev/receipt/format/(?P<format>[1-9][0-9]*)/schema\.json$")
# Formats older than the current one that this toolkit still reads, each with its schema shipped
# as receipt-format-N.schema.json: 3 (the receipt copied the files; format 4 points at them:
# table.py, docs/decisions.md). A change of format either keeps the old one's schema and reader
# (and lists it here) or names the last release that reads it in OLDER_READERS; test_versions
# fails otherwise.
ALSO_READ: tuple[int, ...] = (3,)
# format -> (the last commit whose `verify` reads it, its toolkit version): the receipt schema's
# `schema_version` const moved 1 -> 2 at 46e814e and 2 -> 3 at 9a71d65, before the first release.
OLDER_READERS = {1: ("e098f4449721", "0.1.0"), 2: ("f4c7a4c49222", "0.1.0")}


def receipt_schema(format: int | None = None) -> dict:
    """The shipped receipt schema of this toolkit's format, or of an older `format` it reads (a Finding
    when it cannot be read: the installation is broken). Read on each call (a millisecond): the
    validator built from it is what is cached."""
    path = resources.receipt_schema() if format is None or format not in ALSO_READ \
        else resources.receipt_schema(f"receipt-format-{format}.schema.json")
    try:
        schema = json.loads(path.read_text())
        return schema if isinstance(schema, dict) else {}
    except (OSError, ValueError) as exc:
        raise Finding(f"{path}: the receipt schema cannot be read ({exc}); this installation of "
                      f"sglang-backport is incomplete, so no bundle can be verified") from exc


def current() -> int:
    """The format this toolkit writes, from the shipped schema's `$id`."""
    match = SCHEMA_ID.match(str(receipt_schema().get("$id")))
    if match is None:
        raise Finding(
            f"{resources.receipt_schema()}: its $id {receipt_schema().get('$id')!r} names no bundle "
            f"format; this installation of sglang-backport is broken"
        )
    return int(match["format"])


def readable() -> tuple[int, ...]:
    """The formats this toolkit's `verify` reads."""
    return (*ALSO_READ, current())


def format_of(bundle: Path) -> tuple[int | None, str | None]:
    """(the format a bundle's receipt says, the toolkit version that wrote it); Nones when the
    receipt does not say (then the ordinary checks say what is wrong with it)."""
    try:
        predicate = json.loads((bundle / RECEIPT).read_bytes())["predicate"]
        found = predicate["schema_version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    if not isinstance(found, int) or isinstance(found, bool):
        return None, None
    toolkit = predicate.get("toolkit")
    wrote = toolkit.get("version") if isinstance(toolkit, dict) else None
    return found, wrote if isinstance(wrote, str) else None


def check_readable(bundle: Path) -> None:
    """BadInput, one line, when this toolkit cannot read the bundle's format."""
    found, wrote = format_of(bundle)
    if found is None or found in readable():
        return
    by = f", written by sglang-backport {wrote}" if wrote else ""
    reads = "format" + ("s " if len(readable()) > 1 else " ") + ", ".join(map(str, readable()))
    if found > current():
        raise BadInput(f"{bundle}: bundle format {found}{by}; sglang-backport {__version__} reads {reads}: "
                       f"verify it with the release that wrote it or a newer one")
    commit, version = OLDER_READERS.get(found, (None, None))
    if commit is None:
        raise BadInput(f"{bundle}: bundle format {found}{by}, which no sglang-backport wrote; "
                       f"sglang-backport {__version__} reads {reads}")
    raise BadInput(f"{bundle}: bundle format {found}{by}; sglang-backport {__version__} reads {reads}: "
                   f"verify it with sglang-backport {version} as of commit {commit}, the last that reads "
                   f"format {found}")
