"""Where SGLang source comes from: PyPI wheels, git commits, local paths, an installed package.

One small interface for the family (`Source.materialise`), one class per spec form.
SGLang code reaches the project only through these, at run time.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

import git
from packaging.version import InvalidVersion, Version

from backport import cache
from backport.errors import BadInput
from backport.tree import (
    Tree,
    commit_all,
    find_package_prefix,
    git_describe_version,
    open_tree,
    read_version,
    tree_digest,
)

DEFAULT_TARGETS = Path(__file__).resolve().parent.parent / "patches" / "targets.toml"
WHEEL_PLATFORM = ("--platform", "manylinux_2_34_x86_64", "--python-version", "3.11",
                  "--implementation", "cp", "--abi", "cp311", "--only-binary=:all:")


@dataclass(frozen=True)
class WheelPin:
    version: str
    filename: str
    sha256: str


@dataclass(frozen=True)
class Fetched:
    tree: Tree
    cached: bool

    def to_json(self) -> dict:
        return {**self.tree.to_json(), "cached": self.cached}


class Source(Protocol):
    spec: str

    def materialise(self, root: Path) -> Fetched: ...


def load_pins(path: Path | None = None) -> dict[str, WheelPin]:
    """Wheel pins from patches/targets.toml (or the file named by SGLANG_BACKPORT_TARGETS)."""
    path = path or Path(os.environ.get("SGLANG_BACKPORT_TARGETS") or DEFAULT_TARGETS)
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"{path}: cannot read the target pins ({exc})") from None
    return {entry["version"]: WheelPin(**entry) for entry in data.get("wheel", [])}


def _sha256_file(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _entry_tree(entry: Path) -> Fetched | None:
    sidecar = entry / "target.json"
    if not sidecar.is_file():
        return None
    return Fetched(Tree.from_json(json.loads(sidecar.read_text())), cached=True)


def _commit_message(tree: Tree) -> str:
    return (
        f"Pristine SGLang {tree.version} from {tree.spec}\n\n"
        f"Spec: {tree.spec}\nVersion: {tree.version}\n"
        f"Artifact-SHA256: {tree.artifact_sha256 or 'none'}\n"
        f"Tree-Digest: {tree.tree_digest}\nUnpinned: {str(tree.unpinned).lower()}\n"
    )


def _snapshot(entry: Path, fill, *, spec: str, version_hint: str | None,
              artifact_sha256: str | None, unpinned: bool = False) -> Fetched:
    """Build `entry/tree` as a one-commit git repository holding a pristine package."""

    def build(staged: Path) -> None:
        work = staged / "tree"
        work.mkdir()
        fill(work)
        version = read_version(work) or version_hint or "unknown"
        draft = Tree(work, "", version, spec, artifact_sha256, tree_digest(work), None, unpinned)
        repo = git.Repo.init(work)
        commit = commit_all(repo, _commit_message(draft))
        repo.close()
        final_tree = Tree(entry / "tree", "", version, spec, artifact_sha256, draft.tree_digest, commit, unpinned)
        cache.write_json_atomic(staged / "target.json", final_tree.to_json())

    created = cache.build_entry(entry, build)
    found = _entry_tree(entry)
    assert found is not None
    return Fetched(found.tree, cached=not created)


# ---- PyPI wheels ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WheelSource:
    spec: str
    version: str
    pin: WheelPin | None  # None: fetched with --allow-unpinned, recorded as unpinned

    def materialise(self, root: Path) -> Fetched:
        if self.pin is not None:
            entry = root / "trees" / f"wheel-{self.pin.sha256}"
            hit = _entry_tree(entry)
            if hit:
                return hit
        wheel = self._download(root)
        digest = _sha256_file(wheel)
        if self.pin is not None and digest != self.pin.sha256:
            wheel.unlink(missing_ok=True)
            raise BadInput(f"{self.spec}: wheel sha256 {digest} does not match the pin {self.pin.sha256}")
        entry = root / "trees" / f"wheel-{digest}"
        hit = _entry_tree(entry)
        if hit:
            return hit
        return _snapshot(entry, lambda work: extract_wheel_package(wheel, work, self.spec),
                         spec=self.spec, version_hint=self.version, artifact_sha256=digest,
                         unpinned=self.pin is None)

    def _download(self, root: Path) -> Path:
        wheels = root / "wheels"
        if self.pin is not None:
            kept = wheels / self.pin.filename
            if kept.is_file() and _sha256_file(kept) == self.pin.sha256:
                return kept
        with tempfile.TemporaryDirectory(prefix="sglang-backport-dl-") as tmp:
            # pip, so the user's own configuration (index, mirrors, proxies) applies.
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "-d", tmp, *WHEEL_PLATFORM, f"sglang=={self.version}"]
            print(f"downloading sglang=={self.version} with pip ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            found = sorted(Path(tmp).glob("sglang-*.whl"))
            if proc.returncode != 0 or not found:
                last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
                raise BadInput(f"{self.spec}: pip download failed: {last}")
            wheel = found[0]
            if self.pin is not None and wheel.name != self.pin.filename:
                raise BadInput(f"{self.spec}: pip returned {wheel.name}, the pin names {self.pin.filename}")
            kept = wheels / wheel.name
            cache.write_file_atomic(kept, wheel.read_bytes())
            return kept


def _record_digest(value: str) -> str:
    algo, _, b64 = value.partition("=")
    if algo != "sha256":
        return ""
    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()


def extract_wheel_package(wheel: Path, dest: Path, label: str) -> None:
    """Extract only `sglang/`, checking every file against the wheel's RECORD first."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as exc:
        raise BadInput(f"{label}: {wheel.name} is not a readable wheel ({exc})") from None
    with archive:
        names = archive.namelist()
        records = [n for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)]
        if len(records) != 1:
            raise BadInput(f"{label}: {wheel.name} has no single .dist-info/RECORD")
        try:
            rows = list(csv.reader(io.TextIOWrapper(archive.open(records[0]), encoding="utf-8")))
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise BadInput(f"{label}: {wheel.name}: RECORD is unreadable ({exc})") from None
        expected = {row[0]: (row[1], row[2]) for row in rows if row and row[0].startswith("sglang/")}
        members = [n for n in names if n.startswith("sglang/") and not n.endswith("/")]
        for name in members:
            parts = PurePosixPath(name).parts
            if name.startswith("/") or ".." in parts:
                raise BadInput(f"{label}: {wheel.name}: unsafe path {name!r}")
            if name not in expected:
                raise BadInput(f"{label}: {wheel.name}: {name} is not listed in RECORD")
        missing = sorted(set(expected) - set(members))
        if missing:
            raise BadInput(f"{label}: {wheel.name}: RECORD lists {missing[0]}, which the wheel lacks")
        for name in members:
            try:
                data = archive.read(name)
            except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as exc:
                raise BadInput(f"{label}: {wheel.name}: {name} cannot be read ({exc})") from None
            digest, size = expected[name]
            if _record_digest(digest) != hashlib.sha256(data).hexdigest() or (size and int(size) != len(data)):
                raise BadInput(f"{label}: {wheel.name}: {name} does not match its RECORD digest")
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


# ---- git ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GitSource:
    spec: str
    url: str
    commit: str

    def materialise(self, root: Path) -> Fetched:
        entry = root / "trees" / f"git-{self.commit}"
        hit = _entry_tree(entry)
        if hit:
            return hit

        def build(staged: Path) -> None:
            work = staged / "tree"
            try:
                repo = git.Repo.clone_from(self.url, work, no_checkout=True)
            except git.GitCommandError as exc:
                raise BadInput(f"{self.spec}: cannot clone {self.url} ({_git_reason(exc)})") from None
            try:
                full = repo.git.rev_parse("--verify", "--quiet", f"{self.commit}^{{commit}}")
            except git.GitCommandError:
                raise BadInput(f"{self.spec}: commit {self.commit} does not exist in {self.url}") from None
            repo.git.checkout("-q", "--detach", full)
            prefix = find_package_prefix(work)
            if prefix is None:
                raise BadInput(f"{self.spec}: commit {self.commit} holds no sglang package")
            package_root = work / prefix if prefix else work
            version = read_version(package_root) or git_describe_version(repo) or "unknown"
            tree = Tree(entry / "tree", prefix, version, self.spec, full, tree_digest(package_root), full)
            repo.close()
            cache.write_json_atomic(staged / "target.json", tree.to_json())

        created = cache.build_entry(entry, build)
        found = _entry_tree(entry)
        assert found is not None
        return Fetched(found.tree, cached=not created)


def _git_reason(exc: git.GitCommandError) -> str:
    lines = [ln.strip() for ln in str(exc.stderr or exc).splitlines() if ln.strip()]
    fatal = [ln for ln in lines if "fatal:" in ln]
    return (fatal or lines or ["git failed"])[-1].strip("'").replace("stderr: ", "")


# ---- local paths and installed packages -----------------------------------------------------


def _snapshot_package(root: Path, spec: str, package_root: Path, version: str | None) -> Fetched:
    """Copy a plain (non-git) package into the cache as a pristine one-commit tree."""
    return _snapshot(root / "trees" / f"path-{tree_digest(package_root)}",
                     lambda work: shutil.copytree(package_root / "sglang", work / "sglang",
                                                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc")),
                     spec=spec, version_hint=version, artifact_sha256=None)


@dataclass(frozen=True)
class PathSource:
    spec: str
    path: Path

    def materialise(self, root: Path) -> Fetched:
        path = self.path.expanduser().resolve()
        if not path.exists():
            raise BadInput(f"{self.spec}: no such path")
        tree = open_tree(path, spec=self.spec)
        if tree.base_commit is not None:
            return Fetched(tree, cached=False)  # a user's checkout: used as it is, never modified
        return _snapshot_package(root, self.spec, tree.package_root, tree.version)


@dataclass(frozen=True)
class InstalledSource:
    spec: str
    python: str

    def materialise(self, root: Path) -> Fetched:
        probe = ("import json, os, sglang; "
                 "print(json.dumps({'dir': os.path.dirname(sglang.__file__), "
                 "'version': getattr(sglang, '__version__', None)}))")
        try:
            proc = subprocess.run([self.python, "-c", probe], capture_output=True, text=True, timeout=300,
                                  check=False)
        except OSError as exc:
            raise BadInput(f"{self.spec}: cannot run {self.python} ({exc.strerror})") from None
        if proc.returncode != 0:
            raise BadInput(f"{self.spec}: {self.python} cannot import sglang")
        found = json.loads(proc.stdout.strip().splitlines()[-1])
        return _snapshot_package(root, self.spec, Path(found["dir"]).parent, found.get("version"))


# ---- spec parsing ---------------------------------------------------------------------------


def parse_spec(spec: str, *, allow_unpinned: bool = False, python: str | None = None,
               pins: dict[str, WheelPin] | None = None) -> Source:
    spec = spec.strip()
    if spec == "installed":
        return InstalledSource(spec, python or sys.executable)
    if spec.startswith("sglang=="):
        raw = spec.removeprefix("sglang==")
        try:
            version = str(Version(raw))
        except InvalidVersion:
            raise BadInput(f"{spec}: {raw!r} is not a valid version") from None
        pins = load_pins() if pins is None else pins
        pin = pins.get(version)
        if pin is None and not allow_unpinned:
            known = ", ".join(sorted(pins, key=Version))
            raise BadInput(f"{spec}: version {version} is not pinned in patches/targets.toml "
                           f"(pinned: {known}); pass --allow-unpinned to fetch it unverified")
        return WheelSource(spec, version, pin)
    if spec.startswith("git+"):
        url, sep, commit = spec[4:].rpartition("@")
        if not sep or not url:
            raise BadInput(f"{spec}: a git target is git+URL@SHA")
        if not re.fullmatch(r"[0-9a-fA-F]{7,40}", commit):
            raise BadInput(f"{spec}: {commit!r} is not a commit id (a git target pins an exact commit)")
        return GitSource(spec, url, commit.lower())
    if re.match(r"^[A-Za-z][A-Za-z0-9_.-]*\s*(==|>=|<=|~=|!=|>|<)", spec):
        raise BadInput(f"{spec}: only sglang==VERSION is a package target")
    return PathSource(spec, Path(spec))


def materialise(spec: str, *, allow_unpinned: bool = False, python: str | None = None) -> Fetched:
    return parse_spec(spec, allow_unpinned=allow_unpinned, python=python).materialise(cache.cache_root())
