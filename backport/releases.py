"""The release matrix (`patches/releases.toml`): every known release, its pin, what it should show.

One row per release holds the facts that used to be spread over pins, tests and README: the
wheel's file name and sha256, the upstream tag's commit, what the engine does with each fix of
the series, and which probe cases are not `safe` on the pristine and on the patched tree. The
fetcher reads the pins from here; tests, nox sessions and README's per-release table are
generated from the rows or checked against them.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache as memoize
from pathlib import Path
from types import MappingProxyType

from packaging.version import InvalidVersion, Version

from backport import resources
from backport.errors import BadInput

RELEASES_ENV = "SGLANG_BACKPORT_RELEASES"
APPLY_OUTCOMES = ("applied", "already-present", "not-applicable")
TREE_VERDICTS = ("safe", "unsafe", "error", "not-applicable")
ROW_KEYS = {"version": str, "wheel": dict, "tag": str, "apply": dict, "pristine": dict, "patched": dict,
            "note": str}
REQUIRED = ("version", "wheel")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def default_path(series: Path | None = None) -> Path:
    """The matrix in force: a pack directory's own `releases.toml` when it has one (a pack that
    ships its own matrix is used with it, never recorded and ignored), else $SGLANG_BACKPORT_RELEASES,
    else the shipped one."""
    if series is not None and (Path(series) / "releases.toml").is_file():
        return Path(series) / "releases.toml"
    return Path(os.environ.get(RELEASES_ENV) or resources.pack_dir() / "releases.toml")


@dataclass(frozen=True)
class WheelPin:
    version: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Release:
    version: str
    pin: WheelPin
    tag: str | None = None
    # None: a pin without expectations (a fixture, or a release not yet measured)
    apply: Mapping[str, str] | None = None
    pristine: Mapping[str, str] = field(default_factory=dict)
    patched: Mapping[str, str] = field(default_factory=dict)
    note: str = ""

    @property
    def measured(self) -> bool:
        return self.apply is not None

    def expected(self, role: str, case: str) -> str:
        """The verdict the matrix expects for `probe/case` on the pristine or patched tree."""
        table = self.pristine if role == "pristine" else self.patched
        return table.get(case, "safe")

    @property
    def applies_anything(self) -> bool:
        return bool(self.apply) and any(v == "applied" for v in self.apply.values())


def _fail(path: Path, where: str, what: str) -> BadInput:
    return BadInput(f"{path}: {where}: {what}")


def _row(path: Path, index: int, row: object) -> Release:
    where = f"release #{index + 1}"
    if not isinstance(row, dict):
        raise _fail(path, where, "is not a table")
    if isinstance(row.get("version"), str):
        where = f"release {row['version']}"
    for key in REQUIRED:
        if key not in row:
            raise _fail(path, where, f"missing key {key!r}")
    for key, value in row.items():
        if key not in ROW_KEYS:
            raise _fail(path, where, f"unknown key {key!r} (known: {', '.join(ROW_KEYS)})")
        if not isinstance(value, ROW_KEYS[key]):
            raise _fail(path, where, f"{key} must be a {ROW_KEYS[key].__name__}, not {type(value).__name__}")
    try:
        version = str(Version(row["version"]))
    except InvalidVersion:
        raise _fail(path, where, f"{row['version']!r} is not a PEP 440 version") from None
    wheel = row["wheel"]
    if set(wheel) != {"file", "sha256"} or not all(isinstance(v, str) for v in wheel.values()):
        raise _fail(path, where, "wheel must be { file = \"...whl\", sha256 = \"<64 hex>\" }")
    if not _SHA256.fullmatch(wheel["sha256"]) or not wheel["file"].endswith(".whl"):
        raise _fail(path, where, f"wheel pin {wheel['file']!r} / {wheel['sha256']!r} is not a .whl and a sha256")
    if "tag" in row and not _COMMIT.fullmatch(row["tag"]):
        raise _fail(path, where, f"tag {row['tag']!r} is not a 40-hex commit id")
    for key, allowed in (("apply", APPLY_OUTCOMES), ("pristine", TREE_VERDICTS), ("patched", TREE_VERDICTS)):
        for name, value in row.get(key, {}).items():
            if value not in allowed:
                raise _fail(path, where, f"{key}.{name} = {value!r}; expected one of {', '.join(allowed)}")
            if key != "apply" and name.count("/") != 1:
                raise _fail(path, where, f"{key}: {name!r} is not a probe/case name")
    if ("pristine" in row or "patched" in row) and "apply" not in row:
        raise _fail(path, where, "expectations without `apply`: a measured row states all three")

    def frozen(key: str) -> Mapping[str, str]:
        return MappingProxyType(dict(row.get(key, {})))

    return Release(version, WheelPin(version, wheel["file"], wheel["sha256"]), row.get("tag"),
                   frozen("apply") if "apply" in row else None, frozen("pristine"), frozen("patched"),
                   row.get("note", ""))


@memoize
def _load(path: Path, mtime_ns: int) -> dict[str, Release]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: no release matrix here") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"{path}: cannot read the release matrix ({exc})") from None
    extra = set(data) - {"release"}
    if extra:
        raise BadInput(f"{path}: unknown top-level key {min(extra)!r} (only [[release]] rows)")
    rows = data.get("release", [])
    if not isinstance(rows, list):
        raise BadInput(f"{path}: `release` must be an array of tables ([[release]])")
    releases: dict[str, Release] = {}
    for index, row in enumerate(rows):
        release = _row(path, index, row)
        if release.version in releases:
            raise _fail(path, f"release {release.version}", "listed twice")
        releases[release.version] = release
    return dict(sorted(releases.items(), key=lambda item: Version(item[0])))


def load_releases(path: Path | None = None) -> dict[str, Release]:
    """Every release of the matrix, oldest first. Bad input (exit 2) names the file and the row."""
    path = (path or default_path()).resolve()
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        mtime = 0
    return dict(_load(path, mtime))


def load_pins(path: Path | None = None) -> dict[str, WheelPin]:
    return {version: release.pin for version, release in load_releases(path).items()}
