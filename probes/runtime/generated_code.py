"""The code `dataclasses` and `typing` generate from text, compiled once for every tree.

Each `@dataclass` class compiles its `__init__`, `__repr__`, `__eq__` (and more) from source
text (`dataclasses._create_fn` runs `exec(text)`), and each string annotation `typing` meets
compiles into a `ForwardRef`: on 0.5.23 some 1,500 and 2,700 compilations in every probe child
(under cProfile 0.19 s and 0.03 s of its import), while the 37 trees of 0.5.10 - 0.5.23 hold
3,697 distinct texts in all. The code depends only on the text, the mode and the interpreter,
so it is stored under the SHA-256 of those (marshal, as a .pyc holds code): a hit is the code
object `compile` gives for exactly that text, with the same file name `<string>`, and runs with
the globals and locals the caller passed. Compilation here never inherits this module's
`__future__` flags (`dont_inherit`), as `dataclasses` and `typing` have none. An entry is written
whole (a temporary file renamed into place); one that does not load is compiled again and
rewritten.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import marshal
import sys
import types
import typing
from importlib.util import MAGIC_NUMBER

from .bytecode import entry_path, store


class CodeCache:
    def __init__(self, folder: str):
        self.folder = folder
        self.codes: dict[tuple[str, str], object] = {}  # this process's hits and misses
        self.compiled = 0  # texts this process found in neither

    def compile(self, source, filename, mode, flags=0, dont_inherit=False, optimize=-1):
        """`compile` for the calls `typing` makes; any other call goes to the built-in one."""
        if not (isinstance(source, str) and filename == "<string>" and flags == 0 and optimize == -1):
            return builtins.compile(source, filename, mode, flags, True, optimize)
        return self._code(source, mode)

    def exec(self, source, globals=None, locals=None, /):
        """`exec` for the calls `dataclasses` makes (text, its globals, a fresh namespace)."""
        if globals is None:  # as exec itself: the caller's namespaces
            frame = sys._getframe(1)
            globals, locals = frame.f_globals, frame.f_locals if locals is None else locals
        code = self._code(source, "exec") if isinstance(source, str) else source
        return builtins.exec(code, globals, locals)  # noqa: S102 - the same exec dataclasses makes, of the text it gave

    def _code(self, source: str, mode: str):
        key = (mode, source)
        code = self.codes.get(key)
        if code is not None:
            return code
        digest = hashlib.sha256(MAGIC_NUMBER + b"%s\0%d\0" % (mode.encode(), sys.flags.optimize)
                                + source.encode("utf-8", "surrogatepass")).hexdigest()
        entry = entry_path(self.folder, digest)
        try:
            with open(entry, "rb") as fh:
                code = marshal.loads(fh.read())
        except (OSError, ValueError, EOFError, TypeError):
            code = None
        if not isinstance(code, types.CodeType):
            code = builtins.compile(source, "<string>", mode, 0, True)
            self.compiled += 1
            store(entry, marshal.dumps(code))
        self.codes[key] = code
        return code


def install(folder: str) -> None:
    """Serve the `exec` of `dataclasses` and the `compile` of `typing` from `folder` (module
    globals: the names are looked up there before the built-ins)."""
    cache = CodeCache(folder)
    dataclasses.exec = cache.exec  # type: ignore[attr-defined]
    typing.compile = cache.compile  # type: ignore[attr-defined]
