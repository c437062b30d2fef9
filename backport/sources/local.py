"""`PATH` and `installed`: a user's checkout (used as it is), a plain directory or an installed package
(snapshotted into the cache as a pristine one-commit tree)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from backport.errors import BadInput
from backport.gitops import uncommitted_paths
from backport.sources.base import Fetched, copy_package, snapshot
from backport.tree import Tree, decided_version, open_tree, tree_digest


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


def pristine_checkout(path: Path, spec: str, pack, version: str | None = None) -> Tree:
    """A user's checkout described as the pristine source of a run: refused (BadInput) when its
    HEAD already carries this pack's work, so that an applied checkout can never be proved as
    the release it started from. `version` is `--version`."""
    import git

    tree = open_tree(path, spec=spec, version=version)
    tree = Tree(tree.path, tree.package_prefix, decided_version(tree, version, "checkout"), tree.spec,
                None, tree.tree_digest, tree.base_commit)
    dirty = uncommitted_paths(tree.path, f"{tree.package_prefix}sglang")
    if dirty:
        raise BadInput(
            f"{tree.path}: uncommitted changes under {tree.package_prefix}sglang/ ({min(dirty)}); `run` "
            f"proves the committed HEAD on a clone: commit or stash them first"
        )
    with git.Repo(tree.path) as repo:
        head = repo.head.commit.hexsha
        # the engine's commits carry these trailers (engine/write.py); any one in HEAD's history
        # means the checkout is (partly) patched, wherever the user committed on top of it
        marked = repo.git.log("--format=%H", "-E", "--grep=^(Backport-Of|Vendor-Fix): ", "HEAD").split()
        base = (
            repo.commit(marked[-1]).parents[0].hexsha if marked and repo.commit(marked[-1]).parents else None
        )
    if marked:
        raise BadInput(
            f"{path}: HEAD {head[:12]} is not a pristine release (commit {marked[0][:12]} carries this "
            f"pack's Backport-Of/Vendor-Fix trailer); `run` proves the release as shipped: run it on "
            f"the base commit {base or '(none)'}, e.g. sglang-backport run git+file://{tree.path}@{base}"
        )
    # Without trailers (squashed, or copied in by hand) the fixes' fingerprints tell: this pack's own
    # fixes are in no release at all, and at a release tag the release's content is known, so an
    # upstream fix it does not ship (fixed_in) was put there after it.
    from backport.engine import detect

    release = Version(tree.version)
    at_tag = release.dev is None and release.post is None
    found = [d.fix for d in detect(tree.package_root, pack, version=tree.version)
             if d.present and d.how.startswith("fingerprint")
             and (pack.fixes[d.fix].is_vendor or (at_tag and not pack.fixes[d.fix].is_fixed_in(release)))]
    if found:
        raise BadInput(
            f"{path}: HEAD {head[:12]} is not a pristine release (it has {', '.join(found)} by "
            f"fingerprint, which sglang {tree.version} does not ship); `run` proves the release as "
            f"shipped: run it on upstream's commit of the release or on sglang=={release.base_version}"
        )
    return tree


# Found, not imported: importing sglang runs its package __init__, which needs numpy, torch and
# the GPU stack (sgl_kernel and friends) that a CPU machine, or an environment inspected from
# outside, may lack.
_FIND_SGLANG = ("import importlib.util, os; spec = importlib.util.find_spec('sglang'); "
                "print(os.path.dirname(os.path.abspath(spec.origin)) if spec and spec.origin else '')")


def installed_package(python: str, label: str) -> Path:
    """The package root (the directory holding `sglang/`) of the sglang that `python` would
    import. BadInput, prefixed with `label`, when there is none."""
    try:
        proc = subprocess.run([python, "-c", _FIND_SGLANG], capture_output=True, text=True, timeout=120,
                              check=False)
    except OSError as exc:
        raise BadInput(f"{label}: cannot run {python} ({exc.strerror})") from None
    except subprocess.TimeoutExpired:
        raise BadInput(f"{label}: {python} did not answer within 120 s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise BadInput(f"{label}: cannot run {python} ({last})")
    found = (proc.stdout.strip().splitlines() or [""])[-1]
    if not found:
        raise BadInput(f"{label}: {python} has no sglang package")
    root = Path(found).parent
    if not (root / "sglang" / "__init__.py").is_file():
        raise BadInput(f"{label}: sglang resolves to {root}, which has no sglang/__init__.py")
    return root


@dataclass(frozen=True)
class InstalledSource:
    spec: str
    python: str

    def materialise(self, root: Path) -> Fetched:
        # the version is read from the snapshot's tree, as for a plain directory
        return _snapshot_package(root, self.spec, installed_package(self.python, self.spec), None)
