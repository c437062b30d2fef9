"""The probe children's cache of the code dataclasses and typing compile from text
(probes/runtime/generated_code.py)."""

from __future__ import annotations

import dataclasses
import marshal
import typing

from probes.runtime import generated_code

TEXT = "def __create_fn__(x):\n def f(self, y: int) -> None:\n  self.y = y + x\n return f"


def _installed(monkeypatch, folder):
    cache = generated_code.CodeCache(str(folder))
    monkeypatch.setattr(dataclasses, "exec", cache.exec, raising=False)
    monkeypatch.setattr(typing, "compile", cache.compile, raising=False)
    return cache


def _point_class():
    @dataclasses.dataclass(frozen=True)
    class Point:
        x: int
        y: list[int] = dataclasses.field(default_factory=list)

    return Point


def test_a_hit_is_the_code_compile_gives_without_this_modules_future_flags(tmp_path):
    cache = generated_code.CodeCache(str(tmp_path))
    code = cache._code(TEXT, "exec")
    assert marshal.dumps(code) == marshal.dumps(compile(TEXT, "<string>", "exec", 0, True))
    again = generated_code.CodeCache(str(tmp_path))._code(TEXT, "exec")  # from disk, a fresh process's view
    assert marshal.dumps(again) == marshal.dumps(code) and again.co_filename == "<string>"
    ns: dict = {}
    exec(again, {}, ns)  # noqa: S102 - the cached code, run as dataclasses runs it
    f = ns["__create_fn__"](1)
    assert f.__annotations__ == {"y": int, "return": None}  # not strings: no `annotations` future inherited


def test_dataclasses_and_forward_refs_behave_as_without_it_and_a_torn_entry_is_recompiled(
    tmp_path, monkeypatch
):
    plain = _point_class()
    want = (repr(plain(1, [2])), plain(1) == plain(1), typing.get_type_hints(plain))
    cache = _installed(monkeypatch, tmp_path)
    first = _point_class()
    assert (repr(first(1, [2])), first(1) == first(1), typing.get_type_hints(first)) == want
    assert cache.compiled > 0
    entries = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(entries) == cache.compiled
    entries[0].write_bytes(b"torn")
    fresh = _installed(monkeypatch, tmp_path)
    second = _point_class()
    assert (repr(second(1, [2])), second(1) == second(1), typing.get_type_hints(second)) == want
    assert fresh.compiled == 1 and entries[0].read_bytes() != b"torn"
    try:
        second(1).x = 2
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("the cached __setattr__ did not freeze the instance")


def test_other_calls_go_to_the_builtins(tmp_path):
    cache = generated_code.CodeCache(str(tmp_path))
    code = cache.compile("1 + 1", "other.py", "eval")
    assert code.co_filename == "other.py" and eval(code) == 2 and cache.compiled == 0
    ns = {"a": 1}
    cache.exec("b = a + 1", ns)
    assert ns["b"] == 2
