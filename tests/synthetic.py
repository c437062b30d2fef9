"""Small synthetic SGLang wheels and trees for the error cases (real wheels cover the happy path)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

PLATFORM_TAG = "cp311-cp311-manylinux_2_34_x86_64"


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def package_files(version: str) -> dict[str, bytes]:
    return {
        "sglang/__init__.py": b"from sglang.version import __version__\n",
        "sglang/_version.py": f"__version__ = version = '{version}'\n".encode(),
        "sglang/version.py": b"from sglang._version import __version__\n",
        "sglang/srt/__init__.py": b"",
        "sglang/srt/disaggregation/__init__.py": b"",
        "sglang/srt/disaggregation/utils.py": b"def is_mla_backend():\n    return False\n",
    }


def build_wheel(
    directory: Path,
    version: str,
    *,
    files: dict[str, bytes] | None = None,
    record_overrides: dict[str, str] | None = None,
    extra_unrecorded: dict[str, bytes] | None = None,
) -> Path:
    """A wheel laid out like SGLang's, with a RECORD; overrides let a test break it on purpose."""
    files = dict(files or package_files(version))
    dist = f"sglang-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n".encode()
    wheel_meta = (
        b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: false\nTag: " + PLATFORM_TAG.encode() + b"\n"
    )
    entries = {**files, f"{dist}/METADATA": metadata, f"{dist}/WHEEL": wheel_meta}
    rows = [f"{name},{record_hash(data)},{len(data)}" for name, data in entries.items()]
    for name, value in (record_overrides or {}).items():
        rows = [f"{name},{value}" if row.split(",")[0] == name else row for row in rows]
    rows.append(f"{dist}/RECORD,,")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"sglang-{version}-{PLATFORM_TAG}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in {**entries, **(extra_unrecorded or {})}.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist}/RECORD", "\n".join(rows) + "\n")
    return path


def write_pins(path: Path, wheels: dict[str, tuple[str, str]]) -> Path:
    """A release matrix (releases.toml) pinning {version: (filename, sha256)}, with no expectations."""
    text = "".join(
        f'[[release]]\nversion = "{v}"\nwheel = {{ file = "{name}", sha256 = "{sha}" }}\n\n'
        for v, (name, sha) in wheels.items()
    )
    path.write_text(text)
    return path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_tree(root: Path, version: str) -> Path:
    for name, data in package_files(version).items():
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return root
