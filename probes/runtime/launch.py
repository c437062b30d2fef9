"""Start the probe child from this package's own folder, wherever it lies (a checkout's `probes/` or an
installed wheel's copy), without putting that folder's parent on `sys.path`: the parent may be a
site-packages holding another SGLang, and the tree under test must be the only `sglang` the child sees.

    python PACKAGE/runtime/launch.py harness --tree PKGROOT [--probe NAME ...]
    python PACKAGE/runtime/launch.py matrix --jobs 2 --out DIR --tree ROOT1 ...

The package is registered as `probes` in this fresh interpreter, so its modules, the case ids and the
tracebacks in a document read the same from a checkout and from a wheel (the package imports itself
relatively and needs no name of its own). Standard library only: it runs before anything else.
"""

import importlib
import importlib.util
import os
import sys
from pathlib import Path

ENTRIES = ("harness", "matrix")


def register(package_dir: Path, name: str = "probes"):
    """Import the probe package in `package_dir` under `name` (its submodules are found in that folder)."""
    spec = importlib.util.spec_from_file_location(name, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"{package_dir}: not a probe package")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    here = Path(__file__).resolve().parent
    # `python FILE` puts FILE's folder first on sys.path: the runtime's modules are not top-level names
    if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == here:
        del sys.path[0]
    if len(sys.argv) < 2 or sys.argv[1] not in ENTRIES:
        print(f"usage: {sys.argv[0]} {{{','.join(ENTRIES)}}} ARGS...", file=sys.stderr)
        sys.exit(2)
    entry = sys.argv.pop(1)
    sys.argv[0] = f"probes.runtime.{entry}"
    register(here.parent)
    runtime = importlib.import_module(f"probes.runtime.{entry}")
    code = runtime.main()
    sys.stdout.flush()
    sys.stderr.flush()
    if getattr(runtime, "FAST_EXIT", False):
        os._exit(code)  # every child is reaped and the summary written: skip torch's 1-2 s of teardown
    sys.exit(code)


if __name__ == "__main__":
    main()
