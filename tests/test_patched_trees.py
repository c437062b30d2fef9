"""The pack's output, held still: every pinned release's patched tree has the git tree id recorded in
tests/data/patched-trees.json (`python -m tests.patched_trees`) (issue 46 item 5).

A change to the pack's files that must not change what it writes (merging two variants into one
Applies-To range, a header edit) keeps every tree id; a change meant to change a patched tree (a new
variant, a fix reaching more releases) regenerates the baseline with `.venv/bin/python -m
tests.patched_trees --write` and says why in its commit.
"""

from __future__ import annotations

import pytest

from backport import gitops
from backport.releases import load_pins
from tests.patched_trees import REGENERATE, recorded

PINNED = list(load_pins())


def test_the_baseline_names_every_pinned_release():
    assert list(recorded()) == PINNED, f"a release was added or removed: regenerate with `{REGENERATE}`"


# Shares the session's patched clones with tests/test_matrix.py and tests/test_pack.py: in the full
# suite it costs a rev-parse per release; alone, a clone and an apply per release (65 releases: about
# 4 minutes on 2 loaded cores, mostly the cache's check of each pristine tree and the checkout).
@pytest.mark.network
@pytest.mark.parametrize("version", PINNED)
def test_patched_tree_is_the_recorded_one(version, patched_tree):
    tree, _ = patched_tree(version)
    got = gitops.run(tree.path, "rev-parse", "HEAD^{tree}").decode().strip()
    assert got == recorded()[version], (
        f"{version}: the patched tree changed; if that is meant, regenerate with `{REGENERATE}`")
