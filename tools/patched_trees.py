"""Every pinned release's patched tree, by git tree id: `python -m tools.patched_trees [--series DIR]
[--write] [VERSION...]`.

For each release of the matrix (patches/releases.toml, measured or not) the pinned wheel's pristine
tree (the cache; fetched on first use) is cloned, the whole pack is applied by the engine as `apply`
and `run` do, and the id of the clone's HEAD tree is recorded. A release the pack cannot serve (a fix
fails: `run` writes an exposure bundle) keeps its pristine tree, so its id is the pristine one.

The tree id covers every byte the pack writes and nothing about how the pack is laid out (commit ids
name the variant file, tree ids do not), so it is what a change to the pack's files that must not
change its output is checked against: merging two variants, widening an Applies-To, moving a header.

    python -m tools.patched_trees                 print {release: tree id} as JSON
    python -m tools.patched_trees --write         rewrite tests/data/patched-trees.json (the baseline
                                                  tests/test_patched_trees.py holds the pack to)
    python -m tools.patched_trees --series DIR    the same for another pack (with its releases.toml)

Regenerate the baseline whenever a change is meant to change a patched tree (a new variant, a fix
that reaches more releases), and say why in the commit.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from backport import gitops
from backport.engine import apply_series
from backport.pack import load_pack
from backport.releases import default_path, load_pins
from backport.resources import pack_dir
from backport.sources import materialise
from backport.tree import clone_tree

BASELINE = Path(__file__).resolve().parent.parent / "tests" / "data" / "patched-trees.json"
REGENERATE = ".venv/bin/python -m tools.patched_trees --write"


def recorded() -> dict[str, str]:
    """The baseline: {release: patched tree id}."""
    return dict(json.loads(BASELINE.read_text())["trees"])


def patched_tree_id(pack, version: str, pins, work: Path) -> str:
    """The git tree id of release `version`'s pristine tree with `pack` applied (under `work`)."""
    pristine = materialise(f"sglang=={version}", pins=pins).tree
    dest = work / version
    tree = clone_tree(pristine, work, dest)
    try:
        apply_series(tree.path, pack, version, package_prefix=tree.package_prefix)
        return gitops.run(tree.path, "rev-parse", "HEAD^{tree}").decode().strip()
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def patched_tree_ids(series: Path, versions: Iterable[str] | None = None) -> dict[str, str]:
    """{release: patched tree id} for `versions` (default: every release the pack's matrix pins), in
    the matrix's order."""
    pack = load_pack(series)
    pins = load_pins(default_path(series))
    wanted = list(pins) if versions is None else [v for v in pins if v in set(versions)]
    with tempfile.TemporaryDirectory(prefix="sglang-patched-trees-") as tmp:
        return {v: patched_tree_id(pack, v, pins, Path(tmp)) for v in wanted}


def main(argv: list[str]) -> int:
    args = list(argv)
    write = "--write" in args
    args = [a for a in args if a != "--write"]
    series = pack_dir()
    if "--series" in args:
        at = args.index("--series")
        if at + 1 >= len(args):
            print("--series needs a pack directory", file=sys.stderr)
            return 2
        series = Path(args[at + 1])
        del args[at:at + 2]
    unknown = sorted(set(args) - set(load_pins(default_path(series))))
    if unknown:
        print(f"{unknown[0]}: not pinned in {default_path(series)}", file=sys.stderr)
        return 2
    if write and args:
        print("--write records every pinned release; name no release with it", file=sys.stderr)
        return 2
    ids = patched_tree_ids(series, args or None)
    if write:
        BASELINE.parent.mkdir(exist_ok=True)
        BASELINE.write_text(json.dumps({"regenerate": REGENERATE, "trees": ids}, indent=1) + "\n")
    sys.stdout.write(json.dumps(ids, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
