"""Run by every Python process of a live-tier server of an old release (this folder is on its
PYTHONPATH only for those setups; backport/live/setups.py decides). Three things, each only when
its variable is set:

SGLANG_BACKPORT_ADDONS=<probes/standins/addons.py>: the probes' add-ons, set in the server processes: the
    names SGLang 0.4.5.post1 - 0.5.1.post3 read at import from torch and triton that torch 2.13 and
    today's triton dropped (set only where the module lacks the name), and the 3FS client module
    where the wheel lacks its C++ source. The same module the probes use, loaded from its file.
SGLANG_BACKPORT_STAND_IN_CPUS=<n>: a stand-in for an n-core host: `os.cpu_count()` reports at
    least n. SGLang 0.4.6 - 0.4.6.post5 size Mooncake's KV sender pool as `cpu_count // 4`, zero
    threads on a machine with fewer than 4 CPUs, and ThreadPoolExecutor(0) stops prefill at start.
    torch sizes its own thread pools without os.cpu_count, so the servers still compute on the
    cores there are.
SGLANG_BACKPORT_CONFIGURED_ROUTE=1: a stand-in for a host whose route lookup answers the address
    the operator configured (SGLANG_HOST_IP, the deployment's 127.0.0.1). SGLang 0.4.5.post1 -
    0.5.2's Mooncake connector takes its own address from sglang.srt.utils.get_local_ip_by_remote
    (the route to a public address), not from SGLANG_HOST_IP: it advertised the host's address,
    and in a namespace without a route prefill stopped. Only that function of that module is
    replaced, as the module finishes loading (the connector imports the name from it), and only
    where the module has it; without SGLANG_HOST_IP the release's own lookup stays.
"""

import importlib.machinery
import importlib.util
import os
import sys

_addons_file = os.environ.get("SGLANG_BACKPORT_ADDONS")
if _addons_file:
    _spec = importlib.util.spec_from_file_location("sglang_backport_server_addons", _addons_file)
    if _spec is None or _spec.loader is None:
        raise ImportError(f"SGLANG_BACKPORT_ADDONS={_addons_file}: not a Python file")
    _addons = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _addons  # dataclasses look the module up while the file runs
    _spec.loader.exec_module(_addons)
    _addons.install_module_standins()
    _addons.install()

_stand_in_cpus = os.environ.get("SGLANG_BACKPORT_STAND_IN_CPUS")
if _stand_in_cpus:
    _real_cpu_count = os.cpu_count
    _floor = int(_stand_in_cpus)

    def cpu_count():
        """The host's CPUs, or the stand-in host's count when that is more (see the module docstring)."""
        return max(_real_cpu_count() or 1, _floor)

    os.cpu_count = cpu_count


_ROUTED_MODULE, _ROUTED_NAME = "sglang.srt.utils", "get_local_ip_by_remote"


class _ConfiguredRouteFinder:
    """Finds sglang.srt.utils as the path finder does and, once it has run, answers its route lookup
    with SGLANG_HOST_IP (see the module docstring)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _ROUTED_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            configured = os.environ.get("SGLANG_HOST_IP")
            if configured and callable(getattr(module, _ROUTED_NAME, None)):
                def get_local_ip_by_remote():
                    """The address the operator configured: the route a stand-in host answers."""
                    return configured

                setattr(module, _ROUTED_NAME, get_local_ip_by_remote)

        # this one loader's exec_module is wrapped on purpose (the module's own finder made it)
        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("SGLANG_BACKPORT_CONFIGURED_ROUTE"):
    sys.meta_path.insert(0, _ConfiguredRouteFinder())
