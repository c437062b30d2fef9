"""probes/standins/addons.py: names older releases read from real packages, set only where a module
lacks them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from probes.standins.addons import ADDONS, AddOn, install

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake_module(monkeypatch):
    module = types.ModuleType("sbp_fake_pkg")
    module.inner = types.SimpleNamespace()
    monkeypatch.setitem(sys.modules, "sbp_fake_pkg", module)
    return module


def test_an_existing_name_is_never_changed(fake_module):
    def real():
        return "the package's own"

    fake_module.present = real
    fake_module.inner.present = None  # even a falsy value is the package's, not a gap
    addons = (AddOn("sbp_fake_pkg", "present", lambda: (lambda: "add-on"), "test"),
              AddOn("sbp_fake_pkg.inner", "present", lambda: "add-on", "test"))
    assert install(addons) == []
    assert fake_module.present is real and fake_module.present() == "the package's own"
    assert fake_module.inner.present is None


def test_a_missing_name_is_added_once_and_an_absent_module_is_skipped(fake_module):
    built = []
    addons = (
        AddOn("sbp_fake_pkg.inner", "missing", lambda: built.append(1) or "add-on", "test"),
        AddOn("sbp_no_such_package.sub", "name", lambda: pytest.fail("built for an absent module"), "test"),
    )
    assert install(addons) == ["sbp_fake_pkg.inner.missing"]
    assert fake_module.inner.missing == "add-on"
    assert install(addons) == [] and built == [1]  # the second time the module has it: left alone


def test_the_triton_names_raise_when_called():
    triton = [a for a in ADDONS if a.module == "triton.runtime.cache"]
    assert sorted(a.name for a in triton) == ["default_cache_dir", "default_dump_dir", "default_override_dir"]
    for addon in triton:
        with pytest.raises(RuntimeError, match=f"triton.runtime.cache.{addon.name} called"):
            addon.value()()


@pytest.mark.probe_env
def test_in_the_probe_environment_only_the_missing_names_are_added(probe_python):
    """torch 2.13 lacks torch._C._cpu._is_amx_tile_supported; the add-on is torch's own public answer,
    and every name torch and triton have is the same object after install() as before."""
    script = (
        "import json, torch, torch.cpu, triton.runtime.cache as cache\n"
        "from probes.standins.addons import ADDONS, install, _resolve\n"
        "before = {(a.module, a.name): getattr(_resolve(a.module), a.name, None) for a in ADDONS}\n"
        "own = {n: getattr(cache, n) for n in dir(cache)}\n"
        "added = install()\n"
        "kept = all(getattr(cache, n) is v for n, v in own.items())\n"
        "print(json.dumps({'added': added, 'kept': kept, 'again': install(),\n"
        "  'amx': torch._C._cpu._is_amx_tile_supported is torch.cpu._is_amx_tile_supported,\n"
        "  'had': [f'{m}.{n}' for (m, n), v in before.items() if v is not None]}))\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([probe_python, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kept"] and result["again"] == [] and result["amx"]
    assert set(result["added"]) | set(result["had"]) == {f"{a.module}.{a.name}" for a in ADDONS}
    assert not set(result["added"]) & set(result["had"])


def test_the_3fs_client_is_stood_in_for_only_where_its_cpp_source_is_missing(tmp_path):
    """0.4.10's wheel ships client_hf3fs.py without the hf3fs_utils.cpp it compiles at import: only
    there does the finder answer; a tree with the source (0.4.10.post2) imports its own module."""
    import importlib.util

    from probes.standins.addons import HF3FS_CLIENT, Hf3fsClientModuleFinder

    finder = Hf3fsClientModuleFinder()
    (tmp_path / "client_hf3fs.py").write_text("raise AssertionError('the tree module ran')\n")
    assert finder.find_spec("sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs", [str(tmp_path)]) is None
    assert finder.find_spec(HF3FS_CLIENT, [str(tmp_path / "elsewhere")]) is None
    spec = finder.find_spec(HF3FS_CLIENT, [str(tmp_path)])
    assert spec is not None and spec.loader is finder
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(RuntimeError, match=r"lacks hf3fs_utils.cpp"):
        module.Hf3fsClient()
    (tmp_path / "hf3fs_utils.cpp").write_text("// the source the module compiles\n")
    assert finder.find_spec(HF3FS_CLIENT, [str(tmp_path)]) is None
