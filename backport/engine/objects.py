"""The series' commits written as one git pack, in process.

``git fast-import`` was the engine's largest cost (a process whose memory pools
fault in on every start, for some 50 small objects); loose objects were no
cheaper here (the first file in each new ``objects/xx`` directory costs about
0.8 ms on this ext4, some 90 of them per series). So every blob, tree and
commit of the series is hashed here and written as one pack with its index
by gitdb's pack writer (undeltified; git gc deltifies later): the pack first,
then its index, each into a temporary file renamed into place once whole, so
git sees all of the series' objects or none. Nothing points at them until the
ref transaction moves HEAD (write.py): a run stopped half-way leaves only
unreachable objects that ``git gc`` prunes. ``git fsck --strict`` in the tests
checks what comes out (sorting, modes, ids).

Where the trees come from: ``base_tree_specs`` names the base commit's tree
of every directory on the way to a touched path; apply.py reads them with one
``git cat-file --batch`` that runs alongside the decision loop (it also gives
the touched files' committed entries, which ``ls-tree`` gave before).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from io import BytesIO
from pathlib import Path

from gitdb.base import OStream
from gitdb.pack import PackEntity

from ..gitops import REGULAR_MODES, object_id

TREE_MODE = 0o040000
PACK_LEVEL = 0  # stored, as fast-import was told (core.compression=0): git gc compresses and deltifies later


def _dirs(path: str) -> list[str]:
    """The directories on the way to ``path``, root ("") first."""
    parts = path.split("/")[:-1]
    return [""] + ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def base_tree_specs(base: str, paths: Iterable[str]) -> dict[str, str]:
    """{directory: ``cat-file`` spec} for the base commit's trees on the way to ``paths``."""
    return {d: f"{base}:{d}" for p in paths for d in _dirs(p)}


class Trees:
    """Directory listings of the base commit, changed commit by commit."""

    def __init__(self, raw: Mapping[str, bytes | None]):
        # {directory: {name: (mode, binsha)}}; a directory the base lacks starts empty
        self.dirs = {d: _parse_tree(data) if data is not None else {} for d, data in raw.items()}

    def entries(self, paths: Iterable[str]) -> dict[str, tuple[str, str]]:
        """{path: (mode, object id)} of the regular files among ``paths`` in the base commit."""
        out = {}
        for p in paths:
            d, _, name = p.rpartition("/")
            mode, sha = self.dirs.get(d, {}).get(name, (0, b""))
            if f"{mode:o}" in REGULAR_MODES:
                out[p] = (f"{mode:o}", sha.hex())
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

    def close(self) -> None:
        """Write the pack, then its index (git reads a pack only through its index): each into a
        temporary file git's own gc removes when left behind, renamed into place once whole."""
        streams = [OStream(sha, kind, len(data), BytesIO(data)) for sha, (kind, data) in self.objects.items()]
        tmp_pack, tmp_idx = self._tmp("tmp_pack_"), self._tmp("tmp_idx_")
        try:
            with open(tmp_pack, "wb") as pack_fh, open(tmp_idx, "wb") as idx_fh:
                pack_sha, _ = PackEntity.write_pack(streams, pack_fh.write, idx_fh.write, len(streams),
                                                    zlib_compression=PACK_LEVEL)
            for tmp, ext in ((tmp_pack, "pack"), (tmp_idx, "idx")):
                os.chmod(tmp, 0o444)
                os.replace(tmp, self.pack_dir / f"pack-{pack_sha.hex()}.{ext}")
        finally:
            for tmp in (tmp_pack, tmp_idx):
                if os.path.lexists(tmp):
                    os.unlink(tmp)

    def _tmp(self, prefix: str) -> str:
        fd, path = tempfile.mkstemp(prefix=prefix, dir=self.pack_dir)
        os.close(fd)
        return path


def write_commits(objects_dir: Path, base: str, trees: Trees,
                  commits: Sequence[tuple[str, str, int, dict]]) -> list[str]:
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
            if val is None:
                listing.pop(name, None)
            else:
                listing[name] = (int(val[0], 8), out.write(b"blob", val[1]))
            dirty.update(_dirs(path))
        for d in sorted(dirty, key=lambda d: -d.count("/") - (d != "")):  # deepest first, root last
            if d == "":
                continue
            up, _, name = d.rpartition("/")
            entries = dirs.get(d, {})
            if entries:
                dirs.setdefault(up, {})[name] = (TREE_MODE, _tree(out, entries))
            else:  # git keeps no empty directory
                dirs.setdefault(up, {}).pop(name, None)
        root = _tree(out, dirs[""]).hex()
        text = (f"tree {root}\nparent {parent}\nauthor {who} {epoch} +0000\n"
                f"committer {who} {epoch} +0000\n\n{message}").encode()
        parent = out.write(b"commit", text).hex()
        ids.append(parent)
    out.close()
    return ids


def _parse_tree(data: bytes) -> dict[str, tuple[int, bytes]]:
    """{name: (mode, binsha)} of a tree git wrote (entries "<octal mode> <name>\\0<20-byte id>"). The
    reader GitPython has (``tree_entries_from_data``) re-checks every name and cost more than the
    rest of the commit writing; these trees come from git itself."""
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        nul = data.index(b"\0", space)
        out[data[space + 1:nul].decode("utf-8", "surrogateescape")] = (int(data[pos:space], 8), data[nul + 1:nul + 21])
        pos = nul + 21
    return out


def _tree(out: PackWriter, entries: Mapping[str, tuple[int, bytes]]) -> bytes:
    # the format GitPython's tree_to_stream writes, without its per-name checks: every name here
    # came from a git tree or from a pack path checked when the pack loaded (pack/model.py)
    ordered = sorted(((name.encode("utf-8", "surrogateescape"), mode, sha) for name, (mode, sha) in entries.items()),
                     key=lambda e: e[0] + b"/" if e[1] == TREE_MODE else e[0])  # git's order: a tree as "name/"
    return out.write(b"tree", b"".join(b"%o %s\0%s" % (mode, name, sha) for name, mode, sha in ordered))
