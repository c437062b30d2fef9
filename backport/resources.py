"""Where the data the toolkit ships with lives: the patch pack, the probes, the receipt schema.

One home for these paths. Installed (a wheel, `pip install .`, pipx) they are package data
found through importlib.resources, under names of their own (setup.py maps the repository
folders): `sglang_backport_data/patches`, `sglang_backport_data/receipt.schema.json`,
`sglang_backport_probes`. Run from a source checkout, the checkout's own folders win, so an
edit to `patches/` takes effect without reinstalling and a stale installed copy is never used.
"""

from __future__ import annotations

import importlib.resources
from functools import cache as memoize
from pathlib import Path

from backport.errors import BadInput

SOURCE_ROOT = Path(__file__).resolve().parent.parent
DATA_PACKAGE = "sglang_backport_data"
PROBES_PACKAGE = "sglang_backport_probes"


def checkout_root() -> Path | None:
    """The source checkout this `backport` package was imported from, or None when installed."""
    if (SOURCE_ROOT / "pyproject.toml").is_file() and (SOURCE_ROOT / "patches" / "series").is_file():
        return SOURCE_ROOT
    return None


@memoize
def _installed(package: str, *parts: str) -> Path:
    try:
        found = importlib.resources.files(package).joinpath(*parts)
    except ModuleNotFoundError:
        raise BadInput(f"{package}: not installed with sglang-backport (reinstall the toolkit)") from None
    # Data of an installed wheel is on the file system; a zipped install is not supported
    # (git and the probe interpreter need real paths).
    path = Path(str(found))
    if not path.exists():
        raise BadInput(f"{path}: missing from the installed sglang-backport (reinstall the toolkit)")
    return path


def pack_dir() -> Path:
    """The patch pack shipped with the toolkit (series, fixes.toml, releases.toml, variants)."""
    root = checkout_root()
    return root / "patches" if root else _installed(DATA_PACKAGE, "patches")


def probes_dir() -> Path:
    """The probe package that runs inside the probe environment (`runtime/launch.py` registers it from
    this folder; expectations.py reads its case registry from here)."""
    root = checkout_root()
    return root / "probes" if root else _installed(PROBES_PACKAGE)


def receipt_schema(name: str = "receipt.schema.json") -> Path:
    """The receipt schema of the format this toolkit writes; `name` receipt-format-N.schema.json: of an
    older format it still reads (evidence/formats.py)."""
    root = checkout_root()
    return root / "evidence" / name if root else _installed(DATA_PACKAGE, name)


def openvex_schema() -> Path:
    """The OpenVEX 0.2.0 schema this project wrote from the spec (evidence/openvex.schema.json)."""
    root = checkout_root()
    return (
        root / "evidence" / "openvex.schema.json" if root else _installed(DATA_PACKAGE, "openvex.schema.json")
    )


def osv_schema() -> Path:
    """OSV's own JSON schema (evidence/osv.schema.json, vendored from ossf/osv-schema: its source
    commit and licence in docs/vex-and-ci.md), which merge's OSV records are validated against."""
    root = checkout_root()
    return root / "evidence" / "osv.schema.json" if root else _installed(DATA_PACKAGE, "osv.schema.json")
