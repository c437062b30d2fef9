"""The release matrix (`patches/releases.toml`): every known release, its pin, what it should show.

One row per release holds its facts: the wheel's file name and sha256, the upstream tag's commit,
a one-line note, whether it was measured, and the exceptions to the rule. What a measured release
is expected to show (the engine's outcome per fix, every case's verdict on the pristine and the
patched tree) is derived from the pack and the cases' declarations (backport/expectations.py)
plus those exceptions; `Release.apply`, `.pristine`, `.patched` and `.expected()` give the
derived result. The fetcher reads the pins from here; tests, nox sessions and README's
per-release table are generated from the rows or checked against them.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache as memoize
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

from packaging.version import InvalidVersion, Version

from backport import expectations, resources
from backport.errors import BadInput
from backport.expectations import StatedException
from backport.vocab import PatchStatus, TreeVerdict

RELEASES_ENV = "SGLANG_BACKPORT_RELEASES"
APPLY_OUTCOMES = (PatchStatus.APPLIED, PatchStatus.PRESENT, PatchStatus.NOT_APPLICABLE)
TREE_VERDICTS = tuple(TreeVerdict)
ROW_KEYS = {"version": str, "wheel": dict, "tag": str, "measured": bool, "note": str, "exceptions": list}
EXCEPTION_KEYS = {"case", "fix", "pristine", "patched", "apply", "reason"}
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
    # False: a pin without expectations (a fixture, or a release not yet measured)
    measured: bool = False
    note: str = ""
    exceptions: tuple[StatedException, ...] = ()
    pack_root: Path | None = field(default=None, compare=False)  # the pack the expectations derive from

    @cached_property
    def derived(self) -> expectations.Expected | None:
        if not self.measured:
            return None
        pack = expectations.pack_at(self.pack_root or resources.pack_dir())
        return expectations.derive(pack, self.version, self.exceptions, where=f"release {self.version}")

    @property
    def apply(self) -> Mapping[str, str] | None:
        """Per fix of the series: what the engine is expected to do on the pristine tree."""
        return None if self.derived is None else MappingProxyType(dict(self.derived.apply))

    def _not_safe(self, role: str) -> Mapping[str, str]:
        if self.derived is None:
            return MappingProxyType({})
        return MappingProxyType({key: verdict for (r, key), verdict in self.derived.verdicts.items()
                                 if r == role and verdict != TreeVerdict.SAFE})

    @property
    def pristine(self) -> Mapping[str, str]:
        """The cases not expected `safe` on the pristine tree."""
        return self._not_safe("pristine")

    @property
    def patched(self) -> Mapping[str, str]:
        """The cases not expected `safe` on the patched tree."""
        return self._not_safe("patched")

    def expected(self, role: str, case: str) -> str:
        """The verdict the matrix expects for `probe/case` on the pristine or patched tree."""
        if self.derived is None:
            return TreeVerdict.SAFE
        return self.derived.verdicts.get((role, case), TreeVerdict.SAFE)

    @property
    def exposed(self) -> bool:
        """The pack cannot serve this release (a fix has no variant for it): `run` probes the
        pristine tree alone and writes an exposure bundle, exit 1."""
        apply = self.apply or {}
        return bool(apply) and expectations.FAILED in apply.values()

    @property
    def applies_anything(self) -> bool:
        apply = self.apply or {}
        return bool(apply) and any(v == PatchStatus.APPLIED for v in apply.values())


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
        if key in ("apply", "pristine", "patched"):
            raise _fail(path, where, f"{key!r}: expectations are derived now (backport/expectations.py); "
                        "a row states only its exceptions")
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
        raise _fail(
            path, where, f"wheel pin {wheel['file']!r} / {wheel['sha256']!r} is not a .whl and a sha256"
        )
    if "tag" in row and not _COMMIT.fullmatch(row["tag"]):
        raise _fail(path, where, f"tag {row['tag']!r} is not a 40-hex commit id")
    if "exceptions" in row and not row.get("measured"):
        raise _fail(path, where, "exceptions on a row that is not measured: an exception is a measured fact")
    stated = tuple(_exception(path, where, i, entry) for i, entry in enumerate(row.get("exceptions", [])))
    pack_root = path.parent if (path.parent / "series").is_file() else None
    return Release(version, WheelPin(version, wheel["file"], wheel["sha256"]), row.get("tag"),
                   bool(row.get("measured")), row.get("note", ""), stated, pack_root)


def _exception(path: Path, where: str, index: int, entry: object) -> StatedException:
    """One exception: { case = "probe/case", pristine and/or patched = VERDICT, reason = "..." } or
    { fix = "ID", apply = OUTCOME, reason = "..." }."""
    where = f"{where}: exception #{index + 1}"
    if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
        raise _fail(path, where, "is not a table of strings")
    unknown = set(entry) - EXCEPTION_KEYS
    if unknown:
        raise _fail(path, where, f"unknown key {min(unknown)!r} (known: {', '.join(sorted(EXCEPTION_KEYS))})")
    if not entry.get("reason", "").strip():
        raise _fail(path, where, "has no reason: every exception says why in one line")
    if ("case" in entry) == ("fix" in entry):
        raise _fail(path, where, "names exactly one of `case` or `fix`")
    if "case" in entry:
        if entry["case"].count("/") != 1 or "apply" in entry or not ({"pristine", "patched"} & set(entry)):
            raise _fail(
                path, where, "a case exception is { case = \"probe/case\", pristine/patched = VERDICT }"
            )
        for role in ("pristine", "patched"):
            if role in entry and entry[role] not in TREE_VERDICTS:
                raise _fail(
                    path, where, f"{role} = {entry[role]!r}; expected one of {', '.join(TREE_VERDICTS)}"
                )
    elif entry.get("apply") not in APPLY_OUTCOMES or {"pristine", "patched"} & set(entry):
        raise _fail(
            path, where, f"a fix exception is {{ fix = ID, apply = one of {', '.join(APPLY_OUTCOMES)} }}"
        )
    return StatedException(entry["reason"], entry.get("case"), entry.get("fix"), entry.get("pristine"),
                           entry.get("patched"), entry.get("apply"))


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
