"""Standard attestations beside the receipt (filled in below)."""

from __future__ import annotations

from backport import gitops


def git_tree(tree) -> str | None:
    """The git tree id of a probed tree's `sglang/` at its recorded commit (None: not a git tree)."""
    if tree.tree_path is None or tree.package_root is None or not tree.commit:
        return None
    try:
        rel = tree.package_root.relative_to(tree.tree_path).as_posix()
    except ValueError:
        return None
    path = "sglang" if rel in ("", ".") else f"{rel}/sglang"
    try:
        return gitops.run(tree.tree_path, "rev-parse", f"{tree.commit}:{path}").decode().strip() or None
    except (gitops.GitError, OSError):
        return None


def git_trees(trees: dict) -> dict[str, str | None]:
    return {role: git_tree(tree) for role, tree in trees.items()}
