"""The live tier's serving setups without a server: which setup serves which release, what each
puts in the servers' argv and environment, the 4-CPU host stand-in, and a fresh cache's work root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from backport import cache
from backport.errors import BadInput
from backport.live import setups
from backport.live.deployment import DECODE_POOL, decode_flags
from backport.releases import load_releases


def test_every_pinned_release_maps_to_exactly_one_setup():
    for version in load_releases():
        covering = [s.name for s in setups.SETUPS if s.covers(version)]
        assert len(covering) == 1, (version, covering)
        assert setups.serving_for(version).name == covering[0]


def test_every_setup_serves_a_pinned_release_and_every_exception_one_inside_a_setup():
    pinned = list(load_releases())
    for setup in setups.SETUPS:
        assert any(setup.covers(v) for v in pinned), setup.name
    for exception in setups.EXCEPTIONS:
        hit = [v for v in pinned if setups.serving_for(v).exceptions.count(exception.reason)]
        assert hit, exception.releases


@pytest.mark.parametrize(("older", "newer", "older_setup", "newer_setup"), [
    ("0.5.7", "0.5.8", "vllm-layers", "0.5.8+"),
    ("0.5.1.post3", "0.5.2", "addons", "vllm-layers"),
    ("0.4.7", "0.4.7.post1", "reserved-tokens-env", "addons"),
])
def test_boundaries_are_the_releases_the_code_changes_at(older, newer, older_setup, newer_setup):
    assert setups.serving_for(older).name == older_setup
    assert setups.serving_for(newer).name == newer_setup


def test_exceptions_follow_the_code_of_the_releases_they_name():
    assert setups.serving_for("0.4.9").nccl_port and not setups.serving_for("0.4.8.post1").nccl_port
    assert setups.serving_for("0.4.6.post5").stand_in_cpus == 4
    assert setups.serving_for("0.4.6").stand_in_cpus == 4
    assert setups.serving_for("0.4.5.post3").stand_in_cpus is None   # no sender pool sized by cpu_count
    assert setups.serving_for("0.4.7").stand_in_cpus is None         # max(4, ...) there
    assert setups.serving_for("0.4.6.post3").reserved_tokens_env
    hard_coded = setups.serving_for("0.4.6.post2")
    assert not hard_coded.reserved_tokens_env and hard_coded.decode_pool_extra == 512 - 16
    assert setups.serving_for("0.4.10.post1").health_before_warmup
    assert not setups.serving_for("0.4.10.post2").health_before_warmup
    assert setups.serving_for("0.5.22").exceptions == ()


@pytest.mark.parametrize("version", ["0.4.4", "not-a-version"])
def test_a_release_outside_every_setup_is_bad_input(version):
    with pytest.raises(BadInput):
        setups.serving_for(version)


def test_decode_flags_per_setup(tmp_path):
    (tmp_path / "sglang" / "srt").mkdir(parents=True)
    newest = decode_flags(tmp_path, setups.serving_for("0.5.22"))
    assert "--num-reserved-decode-tokens" in newest and str(DECODE_POOL) in newest
    by_env = decode_flags(tmp_path, setups.serving_for("0.4.6.post5"))
    assert "--num-reserved-decode-tokens" not in by_env
    hard_coded = decode_flags(tmp_path, setups.serving_for("0.4.5.post1"))
    assert hard_coded[hard_coded.index("--max-total-tokens") + 1] == str(DECODE_POOL + 496)
    assert "--num-reserved-decode-tokens" not in hard_coded


def test_environment_and_path_per_setup():
    assert setups.server_environment(setups.serving_for("0.5.22"), 16) == {}
    assert setups.pythonpath_extras(setups.serving_for("0.5.22")) == []
    assert setups.pythonpath_extras(setups.serving_for("0.5.5.post1")) == [str(setups.VLLM_LAYERS)]
    env = setups.server_environment(setups.serving_for("0.4.6.post5"), 16)
    assert env["SGLANG_NUM_RESERVED_DECODE_TOKENS"] == "16" and env["SGLANG_BACKPORT_STAND_IN_CPUS"] == "4"
    assert (
        Path(env["SGLANG_BACKPORT_ADDONS"]).name == "addons.py"
        and Path(env["SGLANG_BACKPORT_ADDONS"]).is_file()
    )
    assert setups.pythonpath_extras(setups.serving_for("0.4.10.post2"))[-1] == str(setups.SERVER_ADDONS)
    record = setups.record(setups.serving_for("0.4.6.post5"))
    assert record["name"] == "reserved-tokens-env" and record["exceptions"]
    # 0.4.5.post3 - 0.4.6.post4 cannot pick a memory fraction on a CPU: the setup passes one
    assert record["mem_fraction_static"] is None
    assert setups.record(setups.serving_for("0.4.6.post4"))["mem_fraction_static"] == 0.88
    assert [v for v in ("0.4.5.post2", "0.4.5.post3", "0.4.6.post4", "0.4.6.post5")
            if setups.serving_for(v).mem_fraction_static] == ["0.4.5.post3", "0.4.6.post4"]


def _cpu_count(extra_env: dict[str, str]) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_BACKPORT_")}
    env.update({"PYTHONPATH": str(setups.SERVER_ADDONS), **extra_env})
    out = subprocess.run([sys.executable, "-c", "import os; print(os.cpu_count())"], env=env,
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_the_four_cpu_host_stand_in_reports_at_least_four_and_only_when_asked():
    real = os.cpu_count()
    assert _cpu_count({}) == real
    assert _cpu_count({"SGLANG_BACKPORT_STAND_IN_CPUS": "4"}) == max(real, 4)


def test_the_configured_route_is_set_on_exactly_the_releases_whose_connector_takes_the_routed_address():
    # 0.4.5.post1 - 0.5.2's Mooncake connector calls get_local_ip_by_remote; 0.5.3 tries get_ip first
    for version in load_releases():
        setup = setups.serving_for(version)
        assert setup.configured_route == (Version(version) < Version("0.5.3")), version
        env = setups.server_environment(setup, 16)
        assert ("SGLANG_BACKPORT_CONFIGURED_ROUTE" in env) == setup.configured_route, version
        assert (str(setups.SERVER_ADDONS) in setups.pythonpath_extras(setup)) == (
            setup.configured_route or setup.addons or bool(setup.stand_in_cpus)), version
    assert setups.record(setups.serving_for("0.5.2"))["configured_route"]


_UTILS_LIKE = """import socket
def get_local_ip_by_remote():
    return "routed"
def get_local_ip_auto():
    return get_local_ip_by_remote()
def get_ip():
    return "get_ip"
"""


def _lookups(tmp_path: Path, extra_env: dict[str, str], utils_source: str = _UTILS_LIKE) -> list[str]:
    """What a module importing the name from sglang.srt.utils sees, as Mooncake's connector does,
    in a process started with the server sitecustomize on its path."""
    srt = tmp_path / "sglang" / "srt"
    srt.mkdir(parents=True, exist_ok=True)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (srt / "__init__.py").write_text("")
    (srt / "utils.py").write_text(utils_source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env.update({"PYTHONPATH": os.pathsep.join([str(setups.SERVER_ADDONS), str(tmp_path)]), **extra_env})
    probe = (
        "import json, sglang.srt.utils as u\n"
        "names = [n for n in ('get_local_ip_by_remote', 'get_local_ip_auto', 'get_ip') if hasattr(u, n)]\n"
        "print(json.dumps([getattr(u, n)() for n in names]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def test_the_configured_route_answers_sglang_host_ip_only_when_asked(tmp_path):
    asked = {"SGLANG_BACKPORT_CONFIGURED_ROUTE": "1", "SGLANG_HOST_IP": "127.0.0.1"}
    assert _lookups(tmp_path, {"SGLANG_HOST_IP": "127.0.0.1"}) == ["routed", "routed", "get_ip"]
    # the lookup, and get_local_ip_auto through it (0.4.8 - 0.5.2), answer the configured address; get_ip
    # stays
    assert _lookups(tmp_path, asked) == ["127.0.0.1", "127.0.0.1", "get_ip"]
    # no configured address: the release's own lookup stays
    assert _lookups(tmp_path, {"SGLANG_BACKPORT_CONFIGURED_ROUTE": "1"}) == ["routed", "routed", "get_ip"]
    # a module without the function gains none
    assert _lookups(tmp_path, asked, "def get_ip():\n    return 'get_ip'\n") == ["get_ip"]


def test_a_fresh_cache_has_a_work_root(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(tmp_path / "fresh"))
    assert cache.work_root().is_dir()


RDMA_REQUESTED = """W1206 07:26:44.569913  5829 transfer_engine_py.cpp:120] Using default malloc/free for protocol: rdma
W1206 07:26:44.570116  5829 topology.cpp:201] No RDMA devices found, check your device installation
I1206 07:26:44.570163  5829 tcp_transport.cpp:391] TcpTransport: listen on port 16803
"""  # noqa: E501 - a log line as the server prints it


def test_backend_is_what_the_servers_logs_show(tmp_path):
    from backport.live.tier import backend_from_logs

    old, new = tmp_path / "old.log", tmp_path / "new.log"
    old.write_text(RDMA_REQUESTED)    # the lines of a 0.5.5.post1 prefill, measured
    new.write_text(RDMA_REQUESTED.replace("protocol: rdma", "protocol: tcp"))
    assert backend_from_logs([old]).startswith(
        "mooncake (protocol rdma requested, no RDMA device: tcp transport"
    )
    assert backend_from_logs([new]).startswith("mooncake (protocol tcp;")
    assert "unknown" in backend_from_logs([tmp_path / "missing.log"])
