"""`git+URL@SHA`: a clone at an exact commit (an upstream checkout keeps `sglang/` under `python/`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import git

from backport.errors import BadInput
from backport.sources.base import Fetched, build_tree_entry, entry_tree
from backport.tree import Tree, checkout_version, find_package_prefix, tree_digest


@dataclass(frozen=True)
class GitSource:
    spec: str
    url: str
    commit: str

    def materialise(self, root: Path) -> Fetched:
        entry = root / "trees" / f"git-{self.commit}"
        hit = entry_tree(entry)
        if hit:
            return hit

        def build(staged: Path) -> Tree:
            work = staged / "tree"
            try:
                repo = git.Repo.clone_from(self.url, work, no_checkout=True)
            except git.GitCommandError as exc:
                raise BadInput(f"{self.spec}: cannot clone {self.url} ({git_reason(exc)})") from None
            with repo:
                try:
                    full = repo.git.rev_parse("--verify", "--quiet", f"{self.commit}^{{commit}}")
                except git.GitCommandError:
                    raise BadInput(
                        f"{self.spec}: commit {self.commit} does not exist in {self.url}"
                    ) from None
                repo.git.checkout("-q", "--detach", full)
                prefix = find_package_prefix(work)
                if prefix is None:
                    raise BadInput(f"{self.spec}: commit {self.commit} holds no sglang package")
                package_root = work / prefix if prefix else work
                version = checkout_version(repo, package_root) or "unknown"  # the tag; a file must agree
            return Tree(work, prefix, version, self.spec, full, tree_digest(package_root), full)

        return build_tree_entry(entry, build)


def git_reason(exc: git.GitCommandError) -> str:
    lines = [ln.strip() for ln in str(exc.stderr or exc).splitlines() if ln.strip()]
    fatal = [ln for ln in lines if "fatal:" in ln]
    return (fatal or lines or ["git failed"])[-1].strip("'").replace("stderr: ", "")
