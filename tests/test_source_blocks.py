"""The probe children's cache of where a function's source block ends (probes/runtime/source_blocks.py)."""

from __future__ import annotations

import importlib.util
import inspect

from probes.runtime import source_blocks

BODY = '''import functools


def plain(x):
    # a comment inside
    y = (x +
         1)
    return y
# a comment after the block


@functools.lru_cache
def decorated(x):
    return x
'''


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_hit_is_what_inspect_gives_and_a_torn_entry_is_recomputed(tmp_path, monkeypatch):
    src = tmp_path / "a.py"
    src.write_text(BODY)
    mod = _load(src, "sb_a")
    expected = {f: source_blocks._original(f) for f in (mod.plain, mod.decorated)}
    cache = source_blocks.BlockCache(str(tmp_path / "cache"))
    blocks = []
    real = inspect.getblock
    monkeypatch.setattr(inspect, "getblock", lambda lines: blocks.append(1) or real(lines))
    for f, want in expected.items():
        assert cache.getsourcelines(f) == want  # a miss: computed, then stored
    assert len(blocks) == 2
    other = tmp_path / "b"
    other.mkdir()
    (other / "a.py").write_text(BODY)  # the same text elsewhere (a patched clone) hits
    copy = _load(other / "a.py", "sb_b")
    fresh = source_blocks.BlockCache(str(tmp_path / "cache"))
    assert [fresh.getsourcelines(f) for f in (copy.plain, copy.decorated)] == list(expected.values())
    assert len(blocks) == 2
    for entry in (tmp_path / "cache").rglob("*.json"):
        entry.write_text('{"3": ')  # torn
    again = source_blocks.BlockCache(str(tmp_path / "cache"))
    assert again.getsourcelines(copy.plain) == expected[mod.plain] and len(blocks) == 3
    assert not list((tmp_path / "cache").rglob(".tmp-*"))


def test_changed_text_misses_and_other_objects_go_to_inspect(tmp_path):
    src = tmp_path / "a.py"
    src.write_text(BODY)
    mod = _load(src, "sb_c")
    cache = source_blocks.BlockCache(str(tmp_path / "cache"))
    cache.getsourcelines(mod.plain)
    src2 = tmp_path / "c.py"
    src2.write_text(BODY.replace("return y", "z = y\n    return z"))
    changed = _load(src2, "sb_d")
    lines, _start = cache.getsourcelines(changed.plain)
    assert lines == source_blocks._original(changed.plain)[0] and "return z" in lines[-1]
    assert cache.getsourcelines(mod) == source_blocks._original(mod)  # a module: inspect's own answer
