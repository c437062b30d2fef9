"""The local version label inside an exported wheel's package: `sglang.__version__` says
`X+backport.N`, so `/server_info`, logs and `audit` see a patched build as patched.

The wheel's version module (`sglang/_version.py` from 0.5.x wheels, `sglang/version.py` before)
has its `__version__ = 'X'` literal rewritten to `'X+backport.N'`; nothing else of the module
changes (`__version_tuple__` keeps the release). The rewrite is exactly reversible, so the
patched tree's digest, which receipts and the wheel's record name, is measured on a wheel or an
installed package by taking the label back out of those lines (`unlabelled_digest`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from packaging.version import InvalidVersion, Version

from backport.digests import sha256_bytes, sha256_file
from backport.errors import BadInput
from backport.tree import manifest_digest, manifest_files

VERSION_MODULES = ("sglang/_version.py", "sglang/version.py")
LABEL_PREFIX = "backport."


def _assignment(version: str) -> re.Pattern[bytes]:
    # `__version__ = 'X'` or `__version__ = version = "X"` at the start of a line, as read_version reads it
    return re.compile(rb"""^(__version__\s*=\s*(?:version\s*=\s*)?)(['"])""" + re.escape(version.encode())
                      + rb"""\2""", re.MULTILINE)


def _swap(data: bytes, old: str, new: str) -> tuple[bytes, int]:
    return _assignment(old).subn(lambda m: m.group(1) + m.group(2) + new.encode() + m.group(2), data)


def relabel(name: str, data: bytes, public: str, local: str) -> tuple[bytes, bool]:
    """(the module with its `__version__` literal `public` made `local`, whether it had one)."""
    if name not in VERSION_MODULES:
        return data, False
    new, count = _swap(data, public, local)
    if count and _swap(new, local, public)[0] != data:
        raise BadInput(f"{name}: its version line cannot be labelled reversibly")
    return new, bool(count)


def unlabel(name: str, data: bytes, local: str | None) -> bytes:
    """The module as upstream shipped it: the inverse of `relabel` (unchanged when unlabelled)."""
    public = public_of(local)
    if name not in VERSION_MODULES or local is None or not public or local == public:
        return data
    return _swap(data, local, public)[0]


def public_of(version: str | None) -> str | None:
    try:
        return Version(version).public if version else None
    except InvalidVersion:
        return None


def backport_label(version: str | None) -> str | None:
    """`backport.N` of `X+backport.N`, None for any other version (an upstream release, a distro's label)."""
    try:
        local = Version(version).local if version else None
    except InvalidVersion:
        return None
    return local if local and local.startswith(LABEL_PREFIX) else None


def same_build(code: str | None, server: str | None) -> bool:
    """Whether a server's version fits the audited code's: one release, and a labelled code's patch set on
    the server too (audited `0.5.19+backport.N` against a server's `0.5.19`: a pristine or rolled-back
    node). Unlabelled code (a git tree) fits a labelled server of its release: the tree has no label."""
    if code is None or server is None:
        return False
    if public_of(code) is None or public_of(server) is None:
        return code == server
    label = backport_label(code)
    return public_of(code) == public_of(server) and (label is None or label == backport_label(server))


def unlabelled_digest(members: Iterable[tuple[str, bytes | None, Path | None]], local: str | None) -> str:
    """The tree digest of `sglang/` members (name, bytes or a file to read), with the label taken out."""
    entries = []
    for name, data, path in members:
        if data is None:
            if path is None:
                raise ValueError(f"{name}: a member is its bytes or a file to read, not neither")
            if name not in VERSION_MODULES:  # streamed: no need to hold the file
                entries.append((name, sha256_file(path)))
                continue
            data = path.read_bytes()
        if name in VERSION_MODULES:
            data = unlabel(name, data, local)
        entries.append((name, sha256_bytes(data)))
    return manifest_digest(entries)


def installed_digest(package_root: Path, local: str | None) -> str:
    """`unlabelled_digest` of a package on disk (an installed wheel's site-packages), over the files
    tree.tree_digest counts."""
    root = Path(package_root)
    return unlabelled_digest(
        (
            (path.relative_to(root).as_posix(), literal, None if literal is not None else path)
            for path, literal in manifest_files(root)
        ),
        local,
    )
