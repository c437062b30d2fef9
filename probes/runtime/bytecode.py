"""A tree's compiled modules, cached by the content of their source.

A probe child imports some 800 of a tree's modules; compiling them was two thirds of its import
(0.5.19: 3.0 s, 1.0 s from compiled code). The trees must stay as fetched, so nothing is written
next to their sources (`PYTHONDONTWRITEBYTECODE`), and a patched tree is a fresh clone at a new
path each run, so Python's own `__pycache__` (or a `pycache_prefix`, keyed by path and mtime)
would never hit for it. Here the code object is stored under the SHA-256 of the interpreter's
magic number, its optimisation level and the source bytes: a hit is the code `compile` gives for
exactly these bytes, whatever tree or path they are in; its file name is set to the importing
path (`_imp._fix_co_filename`, as importlib does for a moved .pyc), so tracebacks and coverage
name the tree's own file. An entry is written whole (a temporary file renamed into place); an
entry that does not load is compiled again and replaced.
"""

from __future__ import annotations

import _imp
import hashlib
import marshal
import os
import sys
import tempfile
from importlib import machinery
from importlib.util import MAGIC_NUMBER


class ContentCachedLoader(machinery.SourceFileLoader):
    cache_dir = ""  # set by install()

    def get_code(self, fullname):
        path = self.get_filename(fullname)
        source = self.get_data(path)
        digest = hashlib.sha256(MAGIC_NUMBER + b"%d\0" % sys.flags.optimize + source).hexdigest()
        entry = entry_path(self.cache_dir, digest)
        try:
            with open(entry, "rb") as fh:
                code = marshal.loads(fh.read())
            _imp._fix_co_filename(code, path)
            return code
        except (OSError, ValueError, EOFError, TypeError):
            pass
        code = self.source_to_code(source, path)
        store(entry, marshal.dumps(code))
        return code


def entry_path(folder: str, digest: str, suffix: str = "") -> str:
    """Where a cache of these (bytecode, source blocks, generated code) keeps the entry of ``digest``."""
    return os.path.join(folder, digest[:2], digest + suffix)


def store(entry: str, data: bytes) -> None:
    folder, tmp = os.path.dirname(entry), None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, entry)
    except OSError:  # a read-only or full cache costs speed, never a result
        pass
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)


def install(tree: str, cache_dir: str) -> None:
    """Load the modules under `tree` through the cache in `cache_dir` (every other path is left
    to Python's own finders)."""
    ContentCachedLoader.cache_dir = cache_dir
    tree = os.path.abspath(tree)
    loaders = [(machinery.ExtensionFileLoader, machinery.EXTENSION_SUFFIXES),
               (ContentCachedLoader, machinery.SOURCE_SUFFIXES),
               (machinery.SourcelessFileLoader, machinery.BYTECODE_SUFFIXES)]
    make_finder = machinery.FileFinder.path_hook(*loaders)

    def hook(path: str):
        if path != tree and not os.path.abspath(path).startswith(tree + os.sep):
            raise ImportError("not in the tree")
        return make_finder(path)

    sys.path_hooks.insert(0, hook)
    for path in list(sys.path_importer_cache):
        if path == tree or path.startswith(tree + os.sep):
            del sys.path_importer_cache[path]
