"""A bundle's file names and bytes: canonical JSON, sha256 digests and the SHA256SUMS form.

Users and scripts read these names and this form; they do not change.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from backport.digests import sha256_bytes, sha256_file  # noqa: F401 - part of the bundle layout API

RECEIPT = "receipt.json"
SUMS = "SHA256SUMS"
# The signature over receipt.json (evidence/sign.py): written after SHA256SUMS, so not listed in it.
ENVELOPE = "receipt.dsse.json"
# Signed attestations (attestations.py), one DSSE envelope a line: also written by `sign`, so not listed.
ATTESTATION_SUFFIX = ".intoto.jsonl"
REPORT = "REPORT.md"
APPLY_REPORT = "apply-report.json"
UPSTREAM_TESTS = "upstream-tests.json"
PROBES_DIR = "probes"
# The marker the toolkit writes into every bundle (listed in SHA256SUMS like any other file): with
# receipt.json it is what makes a directory a bundle, so a folder that merely holds a file named
# SHA256SUMS is never taken for one (bundle.py replaces only what it recognises).
MARKER = ".sglang-backport-bundle"
MARKER_BYTES = b"sglang-backport evidence bundle: written by sglang-backport; see receipt.json\n"


def probe_file(role: str) -> str:
    """The bundle file that holds one tree's normalised probe results."""
    return f"{PROBES_DIR}/{role}.json"


# the three trees of a run, in report order: base, head and the upstream-fixed reference
ROLES = ("pristine", "patched", "reference")
BASE, HEAD, REFERENCE = ROLES


def product_role(roles) -> str:
    """The tree a bundle speaks for: the patched (head) tree, or, in an exposure run (the pack has
    no variant for the release, so there is no head), the pristine tree as the operator runs it."""
    return HEAD if HEAD in roles else BASE


def role_of(name: str) -> str | None:
    """The role whose probe results a bundle file holds (None: not a probe file)."""
    if name.startswith(PROBES_DIR + "/") and name.endswith(".json") and name.count("/") == 1:
        return name[len(PROBES_DIR) + 1:-len(".json")]
    return None


def canonical_json(document: Any) -> bytes:
    """The one serialisation every bundle file uses: sorted keys, fixed separators, ASCII, LF."""
    return (json.dumps(document, indent=2, sort_keys=True, separators=(",", ": "), ensure_ascii=True)
            + "\n").encode()


def sums_text(digests: dict[str, str]) -> str:
    """`sha256sum` output for these files, sorted by name (the form `sha256sum -c` reads)."""
    return "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))


_SUM_LINE = re.compile(r"([0-9a-f]{64})  ([^\n]+)")


def parse_sums(data: bytes) -> tuple[dict[str, str] | None, str | None]:
    """(entries, None) for a canonical SHA256SUMS, (None, why) otherwise."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None, "not ASCII text"
    if not text.endswith("\n"):
        return None, "does not end with a newline"
    entries: dict[str, str] = {}
    for number, line in enumerate(text[:-1].split("\n"), 1):
        match = _SUM_LINE.fullmatch(line)
        if not match:
            return None, f"line {number} is not '<sha256>  <name>'"
        name = match.group(2)
        if name in entries or name.startswith("/") or ".." in name.split("/") or "\\" in name:
            return None, f"line {number} names {name!r}, which no bundle file can be"
        entries[name] = match.group(1)
    if sums_text(entries) != text:
        return None, "lines are not in the canonical sorted form"
    return entries, None


def _umask() -> int:
    try:  # Linux says it without changing it; os.umask can only be read by setting it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def as_umask_allows(path: Path) -> None:
    """Give a folder or file that mkdtemp/mkstemp made private (0700/0600) the mode a plain
    create gets (0777/0666 less the umask, so 0755/0644 by default): a bundle is read by a team."""
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~_umask())


def write_readable(path: Path, data: bytes) -> None:
    """Write a file atomically (cache.write_file_atomic, whose mkstemp makes it 0600), then give
    it the mode a plain create would."""
    from backport import cache

    cache.write_file_atomic(path, data)
    as_umask_allows(path)
