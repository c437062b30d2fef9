"""Names older SGLang releases read from real packages that the probe environment's versions dropped.

The stand-in packages in probes/standins/shims/ stand for packages a CPU machine cannot have. These stand
for single names inside packages it does have (torch 2.13, triton 3.x): SGLang 0.4.x and 0.5.1
read them at import time, so without them the tree under test cannot be imported at all.

An add-on is set on a loaded module only when the module lacks the name: a name the module has
is never replaced or wrapped, whatever it is (tests/test_probes.py holds that). Each add-on says
which releases need it and what it stands for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class AddOn:
    module: str                    # the dotted module (or module attribute) that lacks the name
    name: str
    value: Callable[[], object]    # builds what is set (called only when the name is missing)
    why: str                       # which releases read it, and what stands for it


def _never_called(qualified: str) -> Callable[[], object]:
    def build():
        def unavailable(*args, **kwargs):
            raise RuntimeError(f"probe add-on: {qualified} called in the CPU probe environment "
                               f"(the releases that need it only import it)")

        unavailable.__name__ = qualified.rsplit(".", 1)[-1]
        unavailable.__qualname__ = qualified
        return unavailable

    return build


def _amx_tile_supported():
    import torch.cpu

    return torch.cpu._is_amx_tile_supported  # the same question, asked through torch's public module


ADDONS = (
    AddOn("torch._C._cpu", "_is_amx_tile_supported", _amx_tile_supported,
          "0.4.8 - 0.5.1 call it at import; torch 2.13 answers it as torch.cpu._is_amx_tile_supported()"),
    *(AddOn("triton.runtime.cache", name, _never_called(f"triton.runtime.cache.{name}"),
            "0.4.5.post1 - 0.4.9.x import it from triton (newer triton moved it); never called by the probes")
      for name in ("default_cache_dir", "default_dump_dir", "default_override_dir")),
)


def _resolve(dotted: str) -> ModuleType | None:
    """The module (or module attribute, as torch._C._cpu) a dotted name names; None when absent."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part, None)
            if found is None:
                return None
        return found
    return None


def install(addons: tuple[AddOn, ...] = ADDONS) -> list[str]:
    """Set each add-on whose module is there and lacks the name; returns the names set."""
    added = []
    for addon in addons:
        target = _resolve(addon.module)
        if target is None or hasattr(target, addon.name):
            continue
        setattr(target, addon.name, addon.value())
        added.append(f"{addon.module}.{addon.name}")
    return added


# ---------------------------------------------------------------------------
# a module of the tree that its own wheel cannot import on any machine

HF3FS_CLIENT = "sglang.srt.mem_cache.storage.hf3fs.client_hf3fs"


class Hf3fsClientModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands for ``client_hf3fs`` (the 3FS storage client) where the tree lacks the C++ source it builds.

    The module compiles ``hf3fs_utils.cpp`` beside it at import (torch's ``cpp_extension.load``).
    0.4.10's wheel ships the module without that file, and 0.4.10's ``cache_controller`` imports the
    3FS backend at module level (lazily before and after it), so the scheduler cannot be imported
    from that wheel on any machine. Only where the tree's ``client_hf3fs.py`` has no
    ``hf3fs_utils.cpp`` beside it is the module this stand-in, whose ``Hf3fsClient`` raises when
    constructed (no probe uses the 3FS backend); a tree that has the source imports its own module.
    """

    def find_spec(self, fullname, path, target=None):
        if fullname != HF3FS_CLIENT:
            return None
        for entry in path or ():
            if os.path.isfile(os.path.join(entry, "client_hf3fs.py")):
                if os.path.isfile(os.path.join(entry, "hf3fs_utils.cpp")):
                    return None  # the tree's own module
                return importlib.util.spec_from_loader(fullname, self,
                                                       origin="probes.standins.addons stand-in")
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        class Hf3fsClient:
            """Stands for the 3FS client; the probes never use the 3FS storage backend."""

            def __init__(self, *args, **kwargs):
                raise RuntimeError("probe stand-in: the tree's wheel lacks hf3fs_utils.cpp, which the 3FS "
                                   "client compiles; it cannot be used here")

        module.Hf3fsClient = Hf3fsClient


def install_module_standins() -> list[str]:
    """Put the stand-in finders ahead of the path finders, once; returns the modules they may stand for."""
    if not any(isinstance(f, Hf3fsClientModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, Hf3fsClientModuleFinder())
    return [HF3FS_CLIENT]
