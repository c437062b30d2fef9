"""Measure release-matrix rows: `python -m tests.measure_rows 0.5.19 0.5.20 ...`.

Fetches each release, applies the pack to a fresh clone, probes the pristine and patched trees in
one probe matrix, and prints each release's `apply`, `pristine` and `patched` tables in the form
patches/releases.toml holds them, beside what the row says now. A developer reviews the printout
and edits the row (this never writes the matrix: an expectation is a decision, not an output).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from backport.engine import apply_series
from backport.pack import load_pack
from backport.probing import ensure_env, run_matrix
from backport.releases import load_releases
from backport.resources import pack_dir
from backport.sources import materialise
from backport.tree import clone_tree


def toml_table(mapping: dict[str, str]) -> str:
    return "{ " + ", ".join(f'"{k}" = "{v}"' if "/" in k or "-" in k else f'{k} = "{v}"'
                            for k, v in mapping.items()) + " }" if mapping else "{}"


def main(versions: list[str]) -> int:
    releases = load_releases()
    pack = load_pack(pack_dir())
    python = str(ensure_env())
    roots, reports = [], {}
    with tempfile.TemporaryDirectory(prefix="measure-rows-") as tmp:
        for version in versions:
            pristine = materialise(f"sglang=={version}").tree
            patched = clone_tree(pristine, Path(tmp))
            reports[version] = apply_series(patched.path, pack, version)
            roots += [pristine.package_root, patched.package_root]
        docs = iter(run_matrix(python, roots))
        for version in versions:
            row = releases.get(version)
            print(f"# {version}: apply {reports[version].status}")
            print("apply = " + toml_table({p.fix: p.status for p in reports[version].patches}))
            for role in ("pristine", "patched"):
                doc = next(docs)
                observed = {f"{c['probe']}/{c['case']}": c["verdict"] for c in doc["cases"]
                            if c["verdict"] != "safe"}
                print(f"{role} = " + toml_table(observed))
                if row is not None and row.measured and dict(getattr(row, role)) != observed:
                    print(f"#   differs from the row: {toml_table(dict(getattr(row, role)))}")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
