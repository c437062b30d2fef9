"""Names older SGLang releases read from real packages that the probe environment's versions dropped.

The stand-in packages in probes/shims/ stand for packages a CPU machine cannot have. These stand
for single names inside packages it does have (torch 2.13, triton 3.x): SGLang 0.4.x and 0.5.1
read them at import time, so without them the tree under test cannot be imported at all.

An add-on is set on a loaded module only when the module lacks the name: a name the module has
is never replaced or wrapped, whatever it is (tests/test_probes.py holds that). Each add-on says
which releases need it and what it stands for.
"""

from __future__ import annotations

import importlib
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
