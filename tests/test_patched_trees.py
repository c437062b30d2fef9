"""The pack's output, held still: every pinned release's patched tree has the git tree id recorded in
tests/data/patched-trees.json (`python -m tools.patched_trees`), and the pack's files do not repeat
themselves (issue 46 item 5).

A change to the pack's files that must not change what it writes (merging two variants into one
Applies-To range, a header edit) keeps every tree id; a change meant to change a patched tree (a new
variant, a fix reaching more releases) regenerates the baseline with `.venv/bin/python -m
tools.patched_trees --write` and says why in its commit.
"""

from __future__ import annotations

import re
from itertools import pairwise

import pytest
from packaging.version import Version

from backport import gitops
from backport.pack import load_pack
from backport.releases import load_pins
from tests.conftest import REPO
from tools.patched_trees import REGENERATE, recorded

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


def hunk_key(variant) -> tuple:
    """What a variant writes, without where its hunks start: per file (unidiff's parse of the diff)
    its paths and each hunk's lines, type and text. Two variants with the same key differ only in
    line numbers, which the engine's placement finds by offset on its own."""
    return tuple((pf.source_file, pf.target_file, pf.is_added_file, pf.is_removed_file,
                  tuple(tuple((line.line_type, line.value) for line in hunk) for hunk in pf))
                 for pf in variant.patchset)


def first_release(variant, pins: list[str]) -> Version:
    """The oldest pinned release the variant serves (after every pin: it serves none)."""
    return next((Version(r) for r in pins if variant.applies(r)), Version("9999"))


def test_no_two_adjacent_variants_have_identical_hunks():
    """A variant that only moves its predecessor's hunks is no variant: the predecessor's Applies-To
    widens over its releases instead (`refresh` does so; docs/decisions.md)."""
    pack = load_pack(REPO / "patches")
    pins = list(load_pins())
    repeats = set()
    for fid in pack.series:
        ordered = sorted(pack.variants[fid], key=lambda pv: first_release(pv, pins))
        repeats |= {(a.name, b.name) for a, b in pairwise(ordered) if hunk_key(a) == hunk_key(b)}
    assert not repeats, f"repeating variants: {sorted(repeats)}"


def test_release_rows_do_not_restate_which_variants_serve_them():
    """Which variant serves a release is its Applies-To (`sglang-backport apply --check sglang==X` names
    it); a row's note or comment in patches/releases.toml that restates it goes stale, unchecked, as
    soon as variants merge or widen, so none names a variant."""
    pack = load_pack(REPO / "patches")
    text = (REPO / "patches" / "releases.toml").read_text()
    fixes = "|".join(map(re.escape, pack.series))
    variant = re.compile(rf"\b(?:{fixes})-\d+\.\d+")
    assert not variant.findall(text)
