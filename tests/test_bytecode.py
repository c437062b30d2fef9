"""The probe children's cache of compiled modules (probes/runtime/bytecode.py): keyed by content,
never by path."""

from __future__ import annotations

import importlib
import sys

import pytest

from probes.runtime import bytecode


@pytest.fixture
def isolated(monkeypatch):
    """Undo the path hook and the imported test modules afterwards."""
    monkeypatch.setattr(sys, "path_hooks", list(sys.path_hooks))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "path_importer_cache", dict(sys.path_importer_cache))
    before = set(sys.modules)
    yield monkeypatch
    for name in set(sys.modules) - before:
        del sys.modules[name]


def _tree(root, body: str):
    (root / "bcpkg").mkdir(parents=True)
    (root / "bcpkg" / "__init__.py").write_text("")
    (root / "bcpkg" / "mod.py").write_text(body)
    return root


@pytest.fixture
def compiled(isolated) -> list[str]:
    """The paths compiled from source (the cache missed), in order."""
    paths: list[str] = []
    real = bytecode.ContentCachedLoader.source_to_code
    isolated.setattr(bytecode.ContentCachedLoader, "source_to_code",
                     lambda self, data, path: paths.append(path) or real(self, data, path))
    return paths


def _import_from(tree, cache, compiled: list):
    bytecode.install(str(tree), str(cache))
    sys.path.append(str(tree))
    for name in ("bcpkg.mod", "bcpkg"):
        sys.modules.pop(name, None)
    mod = importlib.import_module("bcpkg.mod")
    sys.path.remove(str(tree))
    return mod


def test_same_source_elsewhere_is_a_hit_with_its_own_file_name(tmp_path, compiled):
    cache = tmp_path / "cache"
    body = "def where():\n    return where.__code__.co_filename\nVALUE = 1\n"
    first = _import_from(_tree(tmp_path / "a", body), cache, compiled)
    assert first.VALUE == 1 and len(compiled) == 2  # both modules compiled once
    second = _import_from(_tree(tmp_path / "b", body), cache, compiled)
    assert len(compiled) == 2  # a fresh clone at a new path compiles nothing
    assert second.where() == str(tmp_path / "b" / "bcpkg" / "mod.py") == second.__file__


def test_changed_source_is_compiled_again(tmp_path, compiled):
    cache = tmp_path / "cache"
    _import_from(_tree(tmp_path / "a", "VALUE = 1\n"), cache, compiled)
    changed = _import_from(_tree(tmp_path / "b", "VALUE = 2\n"), cache, compiled)
    assert changed.VALUE == 2 and compiled[-1].endswith("b/bcpkg/mod.py")


def test_a_torn_entry_is_compiled_again_and_replaced(tmp_path, compiled):
    cache = tmp_path / "cache"
    _import_from(_tree(tmp_path / "a", "VALUE = 3\n"), cache, compiled)
    for entry in cache.rglob("*"):
        if entry.is_file():
            entry.write_bytes(entry.read_bytes()[:5])
    again = _import_from(_tree(tmp_path / "b", "VALUE = 3\n"), cache, compiled)
    assert again.VALUE == 3 and len(compiled) == 4
    assert not list(cache.rglob(".tmp-*"))


def test_paths_outside_the_tree_keep_pythons_own_finders(tmp_path, isolated):
    (tmp_path / "tree" / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    bytecode.install(str(tmp_path / "tree"), str(tmp_path / "cache"))
    with pytest.raises(ImportError):
        sys.path_hooks[0](str(tmp_path / "elsewhere"))
    assert isinstance(sys.path_hooks[0](str(tmp_path / "tree" / "sub")), importlib.machinery.FileFinder)
