"""`--wheel`: the upstream wheel with its `sglang/` package replaced by the patched tree's.

Everything else is the original's: its metadata, dependencies, entry points and tags. Only the
version changes, to `X+backport.N` (PEP 440 local label, see `Lineage.label`), with the
dist-info directory renamed to match, and so does the version module's `__version__` (label.py),
so that `sglang.__version__` and `/server_info` say the build is patched; the wheel library
writes RECORD with every member's digest. The dist-info also gets
`sglang_backport.json` (spec, upstream wheel, commits, patch-set and tree digests), so an
installed copy says where it came from. Member dates are fixed: the same patched tree gives
the same wheel bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from installer.sources import WheelFile as CheckedWheel
from packaging.utils import parse_wheel_filename
from packaging.version import Version
from wheel.wheelfile import WheelFile

from backport import cache
from backport.digests import sha256_bytes, sha256_file
from backport.errors import BadInput
from backport.evidence.artifacts import PROVENANCE
from backport.export.label import relabel, unlabel
from backport.export.lineage import Lineage
from backport.tree import is_package_source, manifest_digest

MEMBER_DATE = (2000, 1, 1, 0, 0, 0)  # as the toolkit's pristine commits
SIGNATURES = ("RECORD", "RECORD.jws", "RECORD.p7s")


@dataclass(frozen=True)
class ExportedWheel:
    path: Path
    name: str           # the file name
    sha256: str
    version: str        # X+backport.N
    tree_digest: str    # of its `sglang/` package with the label taken out: the patched tree's
    original: str       # the upstream wheel's file name
    labelled: tuple[str, ...] = ()  # the version modules that say X+backport.N

    def to_json(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "version": self.version,
                "tree_digest": self.tree_digest, "original": self.original}


def original_wheel(lineage: Lineage) -> Path:
    """The upstream wheel the pristine commit was taken from: the cached download (fetched again
    through the pin when it is gone), checked against the recorded sha256."""
    from backport.releases import load_pins
    from backport.sources.wheel import WheelSource

    pin = load_pins().get(lineage.version)
    if pin is not None and pin.sha256 == lineage.artifact_sha256:
        return WheelSource(lineage.spec, lineage.version, pin)._download(cache.cache_root())
    for candidate in sorted((cache.cache_root() / "wheels").glob(f"sglang-{lineage.version}-*.whl")):
        if sha256_file(candidate) == lineage.artifact_sha256:
            return candidate
    raise BadInput(
        f"{lineage.root}: the upstream wheel of {lineage.spec} (sha256 {lineage.artifact_sha256[:12]}...) "
        f"is neither pinned nor in {cache.cache_root() / 'wheels'}"
    )


def _member(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=MEMBER_DATE)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (stat.S_IFREG | mode) << 16
    return info


class _FixedDateWheel(WheelFile):
    """The wheel library's writer, with RECORD (which it adds on close) dated like every member."""

    def writestr(self, zinfo_or_arcname, data, compress_type=None):
        if isinstance(zinfo_or_arcname, str):
            zinfo_or_arcname = _member(zinfo_or_arcname, 0o644)
        super().writestr(zinfo_or_arcname, data, compress_type)


def _relabelled_metadata(text: str, version: str) -> str:
    head, sep, body = text.partition("\n\n")
    head, count = re.subn(r"^Version: .*$", f"Version: {version}", head, count=1, flags=re.MULTILINE)
    if count != 1:
        raise BadInput("the upstream wheel's METADATA has no Version: header")
    return head + sep + body


def _package_files(package_root: Path) -> list[tuple[str, Path]]:
    files = []
    for path in sorted((package_root / "sglang").rglob("*")):
        if not is_package_source(path.as_posix()):
            continue
        if path.is_symlink():
            raise BadInput(f"{path}: a symbolic link; a wheel cannot carry it")
        if path.is_file():
            files.append((path.relative_to(package_root).as_posix(), path))
    return files


def build_wheel(lineage: Lineage, out_dir: Path, original: Path | None = None) -> ExportedWheel:
    from backport.job.progress import heartbeat  # here: the job imports export

    with heartbeat(f"building the patched wheel of {lineage.spec}"):  # ~30 MB, read, hashed and written twice
        return _build_wheel(lineage, out_dir, original)


def _build_wheel(lineage: Lineage, out_dir: Path, original: Path | None) -> ExportedWheel:
    original = original or original_wheel(lineage)
    if sha256_file(original) != lineage.artifact_sha256:
        raise BadInput(f"{original}: does not match the Artifact-SHA256 of {lineage.root}")
    name, version, build, _ = parse_wheel_filename(original.name)
    if version.local or build:
        raise BadInput(f"{original.name}: already carries a local label or build tag")
    new_version = str(Version(f"{version}+{lineage.label}"))
    old_prefix = original.name.split("-")[0] + "-" + original.name.split("-")[1]   # sglang-0.5.19
    tags = original.name[len(old_prefix) + 1:-len(".whl")]                        # cp311-cp311-manylinux...
    new_prefix = f"{name}-{new_version}"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    filename = f"{new_prefix}-{tags}.whl"

    with CheckedWheel.open(original) as checked:
        try:
            checked.validate_record(validate_contents=True)
        except ValueError as exc:
            raise BadInput(
                f"{original.name}: RECORD check failed: {(getattr(exc, 'issues', None) or [exc])[0]}"
            ) from None
    # Written under its own name (WheelFile derives the dist-info from it) in a staging folder,
    # then renamed: a failed export leaves no partial wheel behind.
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=out_dir))
    staged = staging / filename
    try:
        labelled, shipped = [], []
        with zipfile.ZipFile(original) as source, _FixedDateWheel(staged, "w") as target:
            for arcname, path in _package_files(lineage.root):
                data, changed = relabel(arcname, path.read_bytes(), str(version), new_version)
                if changed:
                    labelled.append(arcname)
                target.writestr(_member(arcname, stat.S_IMODE(path.stat().st_mode)), data)
                shipped.append((arcname, sha256_bytes(unlabel(arcname, data, new_version))))
            if not labelled:
                raise BadInput(f"{lineage.root}: no sglang/_version.py or sglang/version.py says "
                               f"__version__ = '{version}'; the wheel could not say it is patched")
            for info in source.infolist():
                top, _, rest = info.filename.partition("/")
                if info.is_dir() or top == "sglang":
                    continue
                if top == f"{old_prefix}.dist-info":
                    if rest in SIGNATURES:
                        continue  # regenerated (RECORD) or no longer valid (signatures)
                    data = source.read(info)
                    if rest == "METADATA":
                        data = _relabelled_metadata(data.decode("utf-8"), new_version).encode("utf-8")
                    top = f"{new_prefix}.dist-info"
                elif top == f"{old_prefix}.data":
                    data, top = source.read(info), f"{new_prefix}.data"
                else:
                    data = source.read(info)
                mode = (info.external_attr >> 16) & 0o777 or 0o644
                target.writestr(_member(f"{top}/{rest}", mode), data)
            provenance = {"spec": lineage.spec, "upstream_wheel": {"name": original.name,
                                                                   "sha256": lineage.artifact_sha256},
                          "pristine_commit": lineage.pristine_commit, "commits": list(lineage.commits),
                          "patch_set_sha256": lineage.patch_set_sha256, "tree_digest": lineage.tree_digest,
                          "version": new_version, "labelled": labelled}
            target.writestr(_member(f"{new_prefix}.dist-info/{PROVENANCE}", 0o644),
                            json.dumps(provenance, indent=2, sort_keys=True) + "\n")
        with CheckedWheel.open(staged) as written:  # our own RECORD must check, as pip will check it
            written.validate_record(validate_contents=True)
        if manifest_digest(shipped) != lineage.tree_digest:  # the label comes back out to the patched tree
            raise BadInput(f"{filename}: its sglang/ is not the patched tree of {lineage.root}")
        final = out_dir / filename
        os.replace(staged, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ExportedWheel(path=final, name=filename, sha256=sha256_file(final), version=new_version,
                         tree_digest=lineage.tree_digest, original=original.name, labelled=tuple(labelled))
