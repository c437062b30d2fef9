"""Run by every Python process of a live-tier server of an old release (this folder is on its
PYTHONPATH only for those setups; backport/live/setups.py decides). Two things, each only when
its variable is set:

SGLANG_BACKPORT_ADDONS=<probes/addons.py>: the probes' add-ons, set in the server processes: the
    names SGLang 0.4.5.post1 - 0.5.1.post3 read at import from torch and triton that torch 2.13 and
    today's triton dropped (set only where the module lacks the name), and the 3FS client module
    where the wheel lacks its C++ source. The same module the probes use, loaded from its file.
SGLANG_BACKPORT_STAND_IN_CPUS=<n>: a stand-in for an n-core host: `os.cpu_count()` reports at
    least n. SGLang 0.4.6 - 0.4.6.post5 size Mooncake's KV sender pool as `cpu_count // 4`, zero
    threads on a machine with fewer than 4 CPUs, and ThreadPoolExecutor(0) stops prefill at start.
    torch sizes its own thread pools without os.cpu_count, so the servers still compute on the
    cores there are.
"""

import importlib.util
import os
import sys

_addons_file = os.environ.get("SGLANG_BACKPORT_ADDONS")
if _addons_file:
    _spec = importlib.util.spec_from_file_location("sglang_backport_server_addons", _addons_file)
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
