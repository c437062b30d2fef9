"""What a patched tree of a wheel target says about itself: its pristine commit (spec, version,
the upstream wheel's sha256) and the backport commits on top, from its git history."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from backport import gitops
from backport.errors import BadInput
from backport.tree import open_tree

_TRAILER = re.compile(r"^(Spec|Version|Artifact-SHA256|Tree-Digest): *(\S+) *$", re.MULTILINE)


@dataclass(frozen=True)
class Lineage:
    root: Path                  # the git work tree; `sglang/` sits at its top (a wheel target)
    spec: str                   # sglang==X
    version: str
    artifact_sha256: str        # the upstream wheel the pristine commit was taken from
    pristine_commit: str
    commits: tuple[str, ...]    # backport commits, oldest first
    tree_digest: str            # of the patched `sglang/` package

    @property
    def patch_set_sha256(self) -> str:
        """One digest of the applied patch set: the backport commit ids in order. The toolkit's
        commits have a fixed author and date, so an id changes exactly when a patch's content,
        its message or the base does."""
        return hashlib.sha256("".join(c + "\n" for c in self.commits).encode()).hexdigest()

    @property
    def label(self) -> str:
        """The PEP 440 local label: `backport.N`, N the first 32 bits of the patch-set digest as
        a decimal number (all digits, so no normalisation rewrites it). It names a patch set; a
        larger N does not mean a newer one."""
        return f"backport.{int(self.patch_set_sha256[:8], 16)}"


def read_lineage(path: Path) -> Lineage:
    tree = open_tree(Path(path))
    root = tree.path
    if tree.package_prefix:
        raise BadInput(f"{root}: an upstream checkout (sglang/ under {tree.package_prefix}); "
                       "export needs a patched tree of a wheel target (sglang==X)")
    try:
        gitops.work_tree(root)
        (pristine,) = gitops.run(root, "rev-list", "--max-parents=0", "HEAD").decode().split()
    except (BadInput, gitops.GitError, ValueError):
        raise BadInput(
            f"{root}: not a tree the toolkit made (no single pristine commit in its git history)"
        ) from None
    trailers = dict(_TRAILER.findall(gitops.commit_message(root, pristine)))
    spec, artifact = trailers.get("Spec", ""), trailers.get("Artifact-SHA256")
    if not spec.startswith("sglang==") or not artifact:
        raise BadInput(
            f"{root}: its pristine commit records no wheel (Spec: sglang==X and Artifact-SHA256:); "
            "export needs a patched tree of a wheel target"
        )
    dirty = sorted(gitops.uncommitted_paths(root, "sglang"))
    if dirty:
        raise BadInput(f"{root}: {len(dirty)} uncommitted change(s) under sglang/ (first: {dirty[0]}); "
                       "the export must be what the commits say")
    commits = tuple(gitops.commits_since(root, pristine))
    if not commits:
        raise BadInput(f"{root}: no backport commits on top of the pristine {spec}; nothing to export")
    return Lineage(root=root, spec=spec, version=trailers.get("Version", spec[len("sglang=="):]),
                   artifact_sha256=artifact, pristine_commit=pristine, commits=commits,
                   tree_digest=tree.tree_digest)
