"""`--patches`: the backport commits as a `git format-patch` series, for operators who build
SGLang from source or in a Dockerfile (`git am` or `patch -p1` in the directory holding
`sglang/`; a full upstream checkout keeps it under `python/`, so `git am --directory=python`)."""

from __future__ import annotations

from pathlib import Path

from backport import gitops
from backport.errors import BadInput
from backport.export.lineage import Lineage


def write_series(lineage: Lineage, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise BadInput(
            f"{out_dir}: exists and is not an empty directory (a series is never written over files)"
        )
    written = gitops.format_patch(lineage.root, lineage.pristine_commit, out_dir)
    if len(written) != len(lineage.commits):
        raise RuntimeError(f"git format-patch wrote {len(written)} files for {len(lineage.commits)} commits")
    return written
