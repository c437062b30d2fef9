"""Shared fixtures: an isolated cache per test, real release trees and the probe interpreter.

Real wheels are downloaded once per test session into a cache under the test workspace
(`.cache/test-wheels` beside the repository, or SGLANG_BACKPORT_TEST_WHEELS), and the
CPU probe environment is built once (or taken from SGLANG_BACKPORT_PROBE_PYTHON).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKSPACE_CACHE = Path(os.environ.get("SGLANG_BACKPORT_TEST_CACHE") or REPO / ".cache" / "test-cache")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """An empty cache for one test; the session's downloaded wheels are linked in to avoid re-downloading."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(root))
    return root


@pytest.fixture(scope="session")
def shared_cache() -> Path:
    """The session-wide cache holding real wheels, pristine trees and the probe environment."""
    WORKSPACE_CACHE.mkdir(parents=True, exist_ok=True)
    return WORKSPACE_CACHE


def _with_cache(root: Path):
    class _Ctx:
        def __enter__(self):
            self.old = os.environ.get("SGLANG_BACKPORT_CACHE")
            os.environ["SGLANG_BACKPORT_CACHE"] = str(root)

        def __exit__(self, *exc):
            if self.old is None:
                os.environ.pop("SGLANG_BACKPORT_CACHE", None)
            else:
                os.environ["SGLANG_BACKPORT_CACHE"] = self.old

    return _Ctx()


@pytest.fixture(scope="session")
def release_tree(shared_cache):
    """release_tree("0.5.19") -> the pristine cached Tree of that pinned release (real PyPI wheel)."""
    from backport.sources import materialise

    def get(version: str):
        with _with_cache(shared_cache):
            return materialise(f"sglang=={version}").tree

    return get


@pytest.fixture(scope="session")
def patched_tree(shared_cache, release_tree, tmp_path_factory):
    """patched_tree("0.5.19") -> (Tree of a fresh clone with the whole pack applied, ApplyReport)."""
    from backport.engine import apply_series
    from backport.pack import load_pack
    from backport.tree import clone_tree

    made: dict[str, tuple] = {}

    def get(version: str):
        if version not in made:
            pristine = release_tree(version)
            dest = tmp_path_factory.mktemp(f"patched-{version}") / "tree"
            tree = clone_tree(pristine, dest.parent, dest)
            report = apply_series(dest, load_pack(REPO / "patches"), version)
            made[version] = (tree, report)
        return made[version]

    return get


@pytest.fixture(scope="session")
def probe_python(shared_cache) -> str:
    """The CPU probe interpreter: SGLANG_BACKPORT_PROBE_PYTHON, else the cached env (built once)."""
    from backport.probing import ensure_env

    with _with_cache(shared_cache):
        return str(ensure_env())


@pytest.fixture(scope="session")
def probe_cases(probe_python, release_tree, patched_tree):
    """probe_cases("prefill_drain", "0.5.21", "pristine"|"patched") -> {case name: case result}:
    one harness run of that probe per tree, cached for the session."""
    from backport.probing import run_harness

    runs: dict[tuple[str, str, str], dict[str, dict]] = {}

    def get(probe: str, version: str, kind: str) -> dict[str, dict]:
        key = (probe, version, kind)
        if key not in runs:
            tree = release_tree(version) if kind == "pristine" else patched_tree(version)[0]
            doc = run_harness(probe_python, tree.package_root, [probe], label=f"{kind} {version}")
            assert doc["version"] == version
            runs[key] = {c["case"]: c for c in doc["cases"]}
        return runs[key]

    return get


@pytest.fixture
def scratch_copy(tmp_path):
    def copy(src: Path, name: str = "copy") -> Path:
        dest = tmp_path / name
        shutil.copytree(src, dest, symlinks=True)
        return dest

    return copy


@pytest.fixture(autouse=True)
def vex_oracle_on_every_bundle(monkeypatch):
    """Every bundle a test places is first checked by the reference matcher (tests/vex_oracle.py):
    what go-vex and trivy would match in its VEX documents, on the bytes as written (before a test
    edits them). Patched where `write_bundle` and `evidence.place_bundle` look the function up."""
    from backport import evidence
    from backport.evidence import bundle as bundle_module
    from tests import vex_oracle

    real = bundle_module.place_bundle

    def checked(out, bundle, *args, **kwargs):
        vex_oracle.check_bundle_files(bundle)
        return real(out, bundle, *args, **kwargs)

    monkeypatch.setattr(bundle_module, "place_bundle", checked)
    monkeypatch.setattr(evidence, "place_bundle", checked)
