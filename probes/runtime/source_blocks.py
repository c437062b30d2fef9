"""Where a function's source block ends, cached by the content of its file.

Triton's `@jit` reads each kernel's source when the kernel is defined (`inspect.getsourcelines`),
and finding where the block ends runs Python's pure-Python tokenizer over it: 80 - 170 kernels,
0.1 - 0.2 s of each probe child's import on 0.5.10 - 0.5.23, the same kernels in nearly every
tree. The answer depends only on the file's text, the line the block starts on and the
interpreter, so it is stored under the SHA-256 of those: an entry is the block's length in lines,
and a hit returns exactly the prefix `inspect.getblock` would (it always returns a prefix of the
lines it is given). Anything that is not a plain function goes to `inspect` unchanged. A file's
entry is written whole (a temporary file renamed into place); one that does not load is ignored
and rewritten.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from importlib.util import MAGIC_NUMBER

from .bytecode import entry_path, store

_original = inspect.getsourcelines


class BlockCache:
    def __init__(self, folder: str):
        self.folder = folder
        self.digests: dict[
            int, tuple[list[str], str]
        ] = {}  # id(lines) -> (lines, digest): linecache reuses a file's list
        self.maps: dict[str, dict[str, int]] = {}

    def _digest(self, lines: list[str]) -> str:
        known = self.digests.get(id(lines))
        if known is not None and known[0] is lines:
            return known[1]
        digest = hashlib.sha256(MAGIC_NUMBER + "".join(lines).encode("utf-8", "surrogatepass")).hexdigest()
        self.digests[id(lines)] = (lines, digest)
        return digest

    def _entry(self, digest: str) -> str:
        return entry_path(self.folder, digest, ".json")

    def _map(self, digest: str) -> dict[str, int]:
        if digest not in self.maps:
            try:
                with open(self._entry(digest), encoding="utf-8") as fh:
                    loaded = json.load(fh)
                ok = isinstance(loaded, dict) and all(isinstance(n, int) and n > 0 for n in loaded.values())
                self.maps[digest] = loaded if ok else {}
            except (OSError, ValueError):
                self.maps[digest] = {}
        return self.maps[digest]

    def getsourcelines(self, obj):
        target = inspect.unwrap(obj)
        if not inspect.isfunction(target):
            return _original(obj)
        lines, lnum = inspect.findsource(target)
        digest = self._digest(lines)
        known = self._map(digest)
        length = known.get(str(lnum))
        if length is not None and lnum + length <= len(lines):
            return lines[lnum:lnum + length], lnum + 1
        block = inspect.getblock(lines[lnum:])
        known[str(lnum)] = len(block)
        store(self._entry(digest), json.dumps(known, sort_keys=True).encode())
        return block, lnum + 1


def install(folder: str) -> None:
    """Serve `inspect.getsourcelines` (and `inspect.getsource`, which calls it) from `folder`."""
    if sys.version_info[:2] != (3, 11):  # the replica of getsourcelines above is 3.11's
        return
    inspect.getsourcelines = BlockCache(folder).getsourcelines
