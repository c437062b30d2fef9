"""`PATH` and `installed`: a user's checkout (used as it is), a plain directory or an installed package
(snapshotted into the cache as a pristine one-commit tree)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from backport.errors import BadInput
from backport.sources.base import Fetched, copy_package, snapshot
from backport.tree import open_tree, tree_digest


def _snapshot_package(root: Path, spec: str, package_root: Path, version: str | None) -> Fetched:
    return snapshot(root / "trees" / f"path-{tree_digest(package_root)}", copy_package(package_root),
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


INSTALLED_PROBE = ("import json, os, sglang; "
                   "print(json.dumps({'dir': os.path.dirname(sglang.__file__), "
                   "'version': getattr(sglang, '__version__', None)}))")


def installed_package(python: str, label: str) -> tuple[Path, str | None]:
    """(package root, version) of the sglang that `python` imports."""
    try:
        proc = subprocess.run([python, "-c", INSTALLED_PROBE], capture_output=True, text=True, timeout=300,
                              check=False)
    except OSError as exc:
        raise BadInput(f"{label}: cannot run {python} ({exc.strerror})") from None
    if proc.returncode != 0:
        raise BadInput(f"{label}: {python} cannot import sglang")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return Path(found["dir"]).parent, found.get("version")


@dataclass(frozen=True)
class InstalledSource:
    spec: str
    python: str

    def materialise(self, root: Path) -> Fetched:
        package_root, version = installed_package(self.python, self.spec)
        return _snapshot_package(root, self.spec, package_root, version)
