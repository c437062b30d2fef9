"""The series' commits written as one git pack, in process.

``git fast-import`` was the engine's largest cost (a process whose memory pools
fault in on every start, for some 50 small objects); loose objects were no
cheaper here (the first file in each new ``objects/xx`` directory costs about
0.8 ms on this ext4, some 90 of them per series). So every blob, tree and
commit of the series is hashed here and written as one pack with its index
by gitdb's pack writer (undeltified; git gc deltifies later): the pack first,
then its index, each into a temporary file renamed into place once whole, so
git sees all of the series' objects or none. Nothing points at them until the
ref transaction moves HEAD (write.py): a run killed half-way leaves only
unreachable objects, and the next run's recovery removes its temporary files
and, rolled back, its pack (both named in the journal first: leftovers.py). ``git fsck --strict`` in the tests
checks what comes out (sorting, modes, ids).

Where the trees come from: the base commit's tree of every directory on the
way to a touched path (they also give the touched files' committed entries).
``read_loose_trees`` reads them straight from loose objects, which is how the
cache's trees and their clones hold them (no process); where one is packed,
``base_tree_specs`` names them for one ``git cat-file --batch`` that runs
alongside the decision loop.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from gitdb.fun import create_pack_object_header, type_to_type_id_map
from gitdb.pack import IndexWriter

from ..gitops import REGULAR_MODES, object_id
from .leftovers import pack_temp

TREE_MODE = b"40000"  # as git writes a tree's mode
PACK_LEVEL = 0  # stored, as fast-import was told (core.compression=0): git gc compresses and deltifies later


def _dirs(path: str) -> list[str]:
    """The directories on the way to ``path``, root ("") first."""
    parts = path.split("/")[:-1]
    return [""] + ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def base_tree_specs(base: str, paths: Iterable[str]) -> dict[str, str]:
    """{directory: ``cat-file`` spec} for the base commit's trees on the way to ``paths``."""
    return {d: f"{base}:{d}" for p in paths for d in _dirs(p)}


def read_loose_trees(objects_dir: Path, base: str, dirs: Iterable[str]) -> Trees | None:
    """The base commit's trees of ``dirs`` and the directories on the way (a directory it lacks, or
    a path that is not one, starts empty), read straight from loose objects, as a checkout made by
    ``git commit`` and the cache's clones hold them: no git process, each tree parsed once. None when
    one of them is not a loose object here (packed, or in an alternate object store): ``git
    cat-file`` reads those (``Trees.parse``)."""
    try:
        kind, commit = _read_loose(objects_dir, base)
        if kind != b"commit" or not commit.startswith(b"tree "):
            return None
        listings = {"": _parse_tree(_read_loose(objects_dir, commit[5:45].decode(), b"tree")[1])}
        every = {a for d in dirs for a in _dirs(f"{d}/.")} - {""}
        for d in sorted(every, key=lambda d: d.count("/")):  # a parent before its children
            up, _, name = d.rpartition("/")
            entry = listings[up].get(_name(name))
            listings[d] = (_parse_tree(_read_loose(objects_dir, entry[-20:].hex(), b"tree")[1])
                           if entry is not None and entry.startswith(TREE_MODE + b" ") else {})
        return Trees(listings)
    except (OSError, ValueError, zlib.error):
        return None


def _read_loose(objects_dir: Path, oid: str, kind: bytes | None = None) -> tuple[bytes, bytes]:
    """(type, content) of a loose object (zlib of ``<type> <size>\\0<content>``); ValueError when
    it is not what it says (or not of ``kind``), OSError when it is not loose here."""
    with open(objects_dir / oid[:2] / oid[2:], "rb") as fh:
        data = zlib.decompress(fh.read())
    nul = data.index(b"\0")
    found, size = data[:nul].split(b" ")
    if int(size) != len(data) - nul - 1 or (kind is not None and found != kind):
        raise ValueError(oid)
    return found, data[nul + 1:]


class Trees:
    """Directory listings of the base commit, changed commit by commit: per directory, its entries
    as git encodes them (``<octal mode> <name>\\0<20-byte id>``) by name, in git's order, so that a
    tree is the join of its listing and an entry git wrote is kept byte for byte."""

    def __init__(self, dirs: dict[str, dict[bytes, bytes]]):
        self.dirs = dirs  # {directory: {name: entry}}; a directory the base lacks is empty

    @classmethod
    def parse(cls, raw: Mapping[str, bytes | None]) -> Trees:
        """From each directory's tree as git stores it (None: the base lacks it)."""
        return cls({d: _parse_tree(data) if data is not None else {} for d, data in raw.items()})

    def entries(self, paths: Iterable[str]) -> dict[str, tuple[str, str]]:
        """{path: (mode, object id)} of the regular files among ``paths`` in the base commit."""
        out = {}
        for p in paths:
            d, _, name = p.rpartition("/")
            entry = self.dirs.get(d, {}).get(_name(name))
            if entry is not None and (mode := entry[:entry.index(b" ")].decode()) in REGULAR_MODES:
                out[p] = (mode, entry[-20:].hex())
        return out


class PackWriter:
    """The series' objects, collected in memory and written as one pack (``close``)."""

    def __init__(self, objects_dir: Path):
        self.pack_dir = objects_dir / "pack"
        self.objects: dict[bytes, tuple[bytes, bytes]] = {}  # binsha -> (type, data)

    def write(self, kind: bytes, data: bytes) -> bytes:
        sha = object_id(kind, data)
        self.objects.setdefault(sha, (kind, data))
        return sha

    def close(self, token: str = "", on_named: Callable[[str], None] | None = None) -> None:
        """Write the pack, then its index (git reads a pack only through its index): each into a
        temporary file named by ``token`` (the journal's: a killed run's are found by it), renamed
        into place once whole. ``on_named`` hears the pack's name before it is created; a pack of
        that name already here holds these very objects (git names a pack by its content): kept."""
        pack_sha, files = self._encode()
        name = f"pack-{pack_sha.hex()}"
        if all((self.pack_dir / f"{name}.{ext}").is_file() for ext, _ in files):
            return
        if on_named is not None:
            on_named(name)
        written: list[str] = []
        try:
            for ext, data in files:
                if token:
                    tmp = str(pack_temp(self.pack_dir, ext, token))
                    fd = os.open(
                        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
                    )
                else:
                    fd, tmp = tempfile.mkstemp(prefix=f"tmp_{ext}_", dir=self.pack_dir)
                written.append(tmp)
                _write_whole(fd, data)
            for tmp, (ext, _) in zip(written, files):
                os.replace(tmp, self.pack_dir / f"{name}.{ext}")
        finally:
            for tmp in written:
                if os.path.lexists(tmp):
                    os.unlink(tmp)

    def _encode(self) -> tuple[bytes, tuple[tuple[str, bytes], tuple[str, bytes]]]:
        """(the pack's id, (("pack", bytes), ("idx", bytes))): a version 2 pack of undeltified
        objects and its index, with gitdb's object headers and index writer."""
        pieces = [struct.pack(">4sLL", b"PACK", 2, len(self.objects))]
        index, offset = IndexWriter(), 12
        for sha, (kind, data) in self.objects.items():
            entry = bytes(create_pack_object_header(type_to_type_id_map[kind], len(data))) + zlib.compress(
                data, PACK_LEVEL)
            index.append(sha, zlib.crc32(entry), offset)
            pieces.append(entry)
            offset += len(entry)
        body = b"".join(pieces)
        pack_sha = hashlib.sha1(body, usedforsecurity=False).digest()
        idx: list[bytes] = []
        index.write(pack_sha, idx.append)
        return pack_sha, (("pack", body + pack_sha), ("idx", b"".join(idx)))


def _write_whole(fd: int, data: bytes) -> None:
    """Write ``data`` to the new temporary file ``fd`` (read-only for everyone, as git's own packs)."""
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        os.fchmod(fh.fileno(), 0o444)


def write_commits(
    objects_dir: Path,
    base: str,
    trees: Trees,
    commits: Sequence[tuple[str, str, int, dict]],
    *,
    token: str = "",
    on_named: Callable[[str], None] | None = None,
) -> list[str]:
    """Write one commit per (author "Name <email>", message, epoch, {repo path:
    (mode, data) | None}), the first on top of ``base``; their ids in order.
    The same input gives the same ids (as git fast-import gave)."""
    out = PackWriter(objects_dir)
    dirs = {d: dict(entries) for d, entries in trees.dirs.items()}
    parent, ids = base, []
    for who, message, epoch, changes in commits:
        dirty: set[str] = set()
        for path, val in changes.items():
            d, _, name = path.rpartition("/")
            listing = dirs.setdefault(d, {})
            _put(listing, _name(name), None if val is None else (val[0].encode(), out.write(b"blob", val[1])))
            dirty.update(_dirs(path))
        for d in sorted(dirty, key=lambda d: -d.count("/") - (d != "")):  # deepest first, root last
            if d == "":
                continue
            up, _, name = d.rpartition("/")
            entries = dirs.get(d, {})
            # git keeps no empty directory
            _put(
                dirs.setdefault(up, {}),
                _name(name),
                (TREE_MODE, out.write(b"tree", b"".join(entries.values()))) if entries else None,
            )
        root = out.write(b"tree", b"".join(dirs[""].values())).hex()
        text = (f"tree {root}\nparent {parent}\nauthor {who} {epoch} +0000\n"
                f"committer {who} {epoch} +0000\n\n{message}").encode()
        parent = out.write(b"commit", text).hex()
        ids.append(parent)
    out.close(token, on_named)
    return ids


def _name(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def _parse_tree(data: bytes) -> dict[bytes, bytes]:
    """{name: entry} of a tree git wrote, in its order. The reader GitPython has
    (``tree_entries_from_data``) re-checks every name and cost more than the rest of the commit
    writing; these trees come from git itself."""
    out, pos = {}, 0
    while pos < len(data):
        nul = data.index(b"\0", pos)
        out[data[data.index(b" ", pos) + 1:nul]] = data[pos:nul + 21]
        pos = nul + 21
    return out


def _put(listing: dict[bytes, bytes], name: bytes, value: tuple[bytes, bytes] | None) -> None:
    """Set (``(mode, binsha)``) or remove (None) one entry of a listing, keeping git's order. Every
    name here came from a git tree or from a pack path checked when the pack loaded (pack/model.py)."""
    if value is None:
        listing.pop(name, None)  # the others keep their order
        return
    new = name not in listing
    listing[name] = b"%s %s\0%s" % (value[0], name, value[1])
    if new:  # git's order sorts a tree as "name/"
        ordered = sorted(listing.items(), key=lambda kv: kv[0] + b"/" if kv[1].startswith(TREE_MODE + b" ")
                         else kv[0])
        listing.clear()
        listing.update(ordered)
