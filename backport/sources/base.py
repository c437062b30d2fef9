"""What every source form shares: the `Fetched` result and the cache entries trees live in.

An entry is `trees/<key>/{tree,target.json}`. A hit is served only after it is checked: the
sidecar parses, the tree's files still hash to the recorded digest and its git history reads.
A damaged entry is moved aside and rebuilt, never trusted. Paths are taken relative to the entry,
so a cache that was moved still works.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import git

from backport import cache
from backport.tree import Tree, commit_all, read_version, tree_digest

log = logging.getLogger("backport.sources")


@dataclass(frozen=True)
class Fetched:
    tree: Tree
    cached: bool

    def to_json(self) -> dict:
        return {**self.tree.to_json(), "cached": self.cached}


class Source(Protocol):
    @property
    def spec(self) -> str: ...  # read-only: the sources are frozen dataclasses

    def materialise(self, root: Path) -> Fetched: ...


def _damage(entry: Path) -> tuple[Tree | None, str | None]:
    """(the entry's tree, None) when it is sound, else (None, what is wrong)."""
    sidecar = entry / "target.json"
    try:
        recorded = Tree.from_json(json.loads(sidecar.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"target.json unreadable ({type(exc).__name__})"
    tree = replace(recorded, path=entry / "tree")
    if not (tree.package_root / "sglang" / "__init__.py").is_file():
        return None, "the tree has no sglang/ package"
    digest = tree_digest(tree.package_root)
    if digest != recorded.tree_digest:
        return None, f"tree digest {digest[:12]} differs from the recorded {recorded.tree_digest[:12]}"
    try:
        with git.Repo(tree.path) as repo:
            if recorded.base_commit and repo.head.commit.hexsha != recorded.base_commit:
                return None, "HEAD is not the recorded pristine commit"
            repo.git.diff("--quiet", "HEAD", "--")  # reads every tree object: a corrupt one fails
    except (git.GitError, ValueError, OSError) as exc:
        return None, f"its git repository does not read ({type(exc).__name__})"
    return tree, None


def entry_tree(entry: Path) -> Fetched | None:
    """A checked cache hit, or None (a damaged entry is moved aside so that it is rebuilt)."""
    if not entry.exists():
        return None
    tree, problem = _damage(entry)
    if tree is not None:
        return Fetched(tree, cached=True)
    log.warning("cache entry %s is damaged (%s); rebuilding it", entry.name, problem)
    cache.discard_dir(entry)
    return None


def build_tree_entry(entry: Path, build: Callable[[Path], Tree]) -> Fetched:
    """Build `entry` atomically: `build(staged)` fills `staged/tree` and returns its Tree."""

    def fill(staged: Path) -> None:
        tree = build(staged)
        cache.write_json_atomic(staged / "target.json", replace(tree, path=entry / "tree").to_json())

    created = cache.build_entry(entry, fill)
    found = entry_tree(entry)
    if found is None:
        raise RuntimeError(f"{entry}: the entry just built does not check")  # a bug, not bad input
    return Fetched(found.tree, cached=not created)


def commit_message(tree: Tree) -> str:
    return (
        f"Pristine SGLang {tree.version} from {tree.spec}\n\n"
        f"Spec: {tree.spec}\nVersion: {tree.version}\n"
        f"Artifact-SHA256: {tree.artifact_sha256 or 'none'}\n"
        f"Tree-Digest: {tree.tree_digest}\nUnpinned: {str(tree.unpinned).lower()}\n"
    )


def snapshot(entry: Path, fill: Callable[[Path], None], *, spec: str, version_hint: str | None,
             artifact_sha256: str | None, unpinned: bool = False) -> Fetched:
    """Build `entry/tree` as a one-commit git repository holding a pristine package."""
    hit = entry_tree(entry)
    if hit:
        return hit

    def build(staged: Path) -> Tree:
        work = staged / "tree"
        work.mkdir()
        fill(work)
        version = read_version(work) or version_hint or "unknown"
        draft = Tree(work, "", version, spec, artifact_sha256, tree_digest(work), None, unpinned)
        with git.Repo.init(work) as repo:
            commit = commit_all(repo, commit_message(draft))
        return replace(draft, base_commit=commit)

    return build_tree_entry(entry, build)


def copy_package(package_root: Path) -> Callable[[Path], None]:
    def fill(work: Path) -> None:
        shutil.copytree(package_root / "sglang", work / "sglang",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))

    return fill
