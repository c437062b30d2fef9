"""`sglang==X`: the PyPI wheel, pinned by file name and sha256 in the release matrix.

The wheel is downloaded with pip (so the user's index, mirrors and proxies apply) into a
temporary directory, checked against its pin, and only then kept in the cache: a download
that does not match never replaces or removes a good wheel. Every file of the wheel is
checked against its RECORD by `installer` before `sglang/` is extracted.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from installer.records import parse_record_file
from installer.sources import WheelFile

from backport import cache
from backport.digests import sha256_file
from backport.errors import BadInput
from backport.releases import WheelPin
from backport.sources.base import Fetched, entry_tree, snapshot

log = logging.getLogger("backport.sources")
WHEEL_PLATFORM = ("--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
                  "--implementation", "cp", "--abi", "cp311", "--only-binary=:all:")


def _edits(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions, adjacent swaps."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def _swapped(a: str, b: str) -> bool:
    """b is a with two characters exchanged (the typo 0.5.91 for 0.5.19)."""
    return len(a) == len(b) and sorted(a) == sorted(b) and sum(x != y for x, y in zip(a, b)) == 2


def unpinned_message(spec: str, version: str, pinned: list[str]) -> str:
    """Why `sglang==version` is refused, answered precisely: the nearest pinned release for a typo,
    newer than the matrix (only this pack's own check applies), or below the supported range.
    --allow-unpinned comes last: it is the way to run an unverified wheel, not a fix for a typo."""
    from packaging.version import Version

    pinned = sorted(pinned, key=Version)
    if not pinned:
        return f"{spec}: {version} is not pinned: the release matrix pins no release; pass --allow-unpinned"
    low, high, wanted = pinned[0], pinned[-1], Version(version)
    span = f"{low} - {high}"
    unverified = "; to prove it anyway from an unverified wheel, pass --allow-unpinned"
    typo = next((v for v in pinned if _swapped(version, v)), None)
    if typo is None and Version(low) <= wanted <= Version(high):
        typo = min(pinned, key=lambda v: (Version(v).release != wanted.release, _edits(version, v),
                                          abs(Version(v).micro - wanted.micro)))
    if typo is not None:
        return (f"{spec}: {version} is not a release in the matrix ({span}); did you mean sglang=={typo}? "
                f"(pinned: {', '.join(pinned)})")
    if wanted > Version(high):
        return (f"{spec}: {version} is newer than the release matrix (newest pinned: {high}): it ships every "
                f"upstream fix this pack carries, so only this pack's own check (sbp-transfer-coverage) "
                f"applies, and no variant of it is measured there" + unverified)
    return (f"{spec}: {version} is below the supported range ({span}): the pack has no backport for it; "
            f"upgrade to a release in the range (0.5.17 or later gets every fix)" + unverified)


@dataclass(frozen=True)
class WheelSource:
    spec: str
    version: str
    pin: WheelPin | None  # None: fetched with --allow-unpinned, recorded as unpinned

    def materialise(self, root: Path) -> Fetched:
        if self.pin is not None:
            hit = entry_tree(root / "trees" / f"wheel-{self.pin.sha256}")
            if hit:
                return hit
        wheel = self._download(root)
        digest = sha256_file(wheel)
        return snapshot(root / "trees" / f"wheel-{digest}",
                        lambda work: extract_wheel_package(wheel, work, self.spec),
                        spec=self.spec, version_hint=self.version, artifact_sha256=digest,
                        unpinned=self.pin is None)

    def _download(self, root: Path) -> Path:
        wheels = root / "wheels"
        if self.pin is not None:
            kept = wheels / self.pin.filename
            if kept.is_file() and sha256_file(kept) == self.pin.sha256:
                return kept
        with tempfile.TemporaryDirectory(prefix="sglang-backport-dl-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "-d", tmp, *WHEEL_PLATFORM, f"sglang=={self.version}"]
            log.info("downloading sglang==%s with pip ...", self.version)
            from backport.job.progress import bytes_under, heartbeat, megabytes  # here: job imports sources

            # pip downloads into its temporary directory (TMPDIR), then moves the wheel to -d: the
            # bytes under both are the download's so far, which a line says every 10 s
            env = {**os.environ, "TMPDIR": str(Path(tmp) / "pip-tmp")}
            os.mkdir(env["TMPDIR"])
            with heartbeat(f"downloading sglang=={self.version}",
                           lambda: f"{megabytes(bytes_under(Path(tmp)))} so far"):
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            found = sorted(Path(tmp).glob("sglang-*.whl"))
            if proc.returncode != 0 or not found:
                last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise BadInput(f"{self.spec}: pip download failed: {last}")
            wheel = found[0]
            if self.pin is not None:
                if wheel.name != self.pin.filename:
                    raise BadInput(
                        f"{self.spec}: pip returned {wheel.name}, the pin names {self.pin.filename}"
                    )
                digest = sha256_file(wheel)
                if digest != self.pin.sha256:
                    raise BadInput(
                        f"{self.spec}: wheel sha256 {digest} does not match the pin {self.pin.sha256}"
                    )
            kept = wheels / wheel.name
            cache.write_file_atomic(kept, wheel.read_bytes())
            return kept


def extract_wheel_package(wheel: Path, dest: Path, label: str) -> None:
    """Extract only `sglang/` after `installer` checked every file of the wheel against RECORD.

    installer checks that each archive member is listed with a matching sha256 and size; the
    other direction (RECORD naming a file the archive lacks) and unsafe member names are
    checked here, since an extracted tree missing a module would still import.
    """
    try:
        with WheelFile.open(wheel) as source:
            try:
                source.validate_record(validate_contents=True)
            except ValueError as exc:
                issues = getattr(exc, "issues", None) or [str(exc)]
                raise BadInput(f"{label}: {wheel.name}: RECORD check failed: {issues[0]}") from None
            listed = {row[0] for row in parse_record_file(source.read_dist_info("RECORD").splitlines())}
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, KeyError) as exc:
        raise BadInput(
            f"{label}: {wheel.name} is not a readable wheel ({type(exc).__name__}: {exc})"
        ) from None
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if not n.endswith("/")]
        missing = sorted(n for n in listed if n.startswith("sglang/") and n not in set(names))
        if missing:
            raise BadInput(f"{label}: {wheel.name}: RECORD lists {missing[0]}, which the wheel lacks")
        for name in names:
            if not name.startswith("sglang/"):
                continue
            parts = PurePosixPath(name).parts
            if name.startswith("/") or ".." in parts:
                raise BadInput(f"{label}: {wheel.name}: unsafe path {name!r}")
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(name))
