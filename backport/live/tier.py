"""The live tier for a list of trees: per tree one PD deployment, every scenario, everything stopped.

Trees run one after another (each pair is ~4 GB and two busy cores); after a tree's pair, its
2P1D deployment runs the page-lifetime race (race.py), the last scenario of its document. One tree's
result is a LiveResult (result.py); its to_json is the document: `{"tree", "version", "server": {version,
setup, flags, backend, router, model_sha256}, "startup_seconds", "scenarios": [{"scenario",
"must_preserve", "expect", "verdict", "observed", "details", "seconds"}]}`.
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
import traceback
from pathlib import Path

from backport import cache
from backport.live.deployment import Deployment, deployed
from backport.live.environment import ROUTER_REQUIREMENTS, ServingEnv
from backport.live.model import TinyModel
from backport.live.race import NAME as RACE_NAME
from backport.live.race import run_race
from backport.live.scenarios import ERROR, REGISTRY, Scenario
from backport.live.servers import sigterm_raises
from backport.records import LiveResult, ScenarioResult

log = logging.getLogger("backport.live")
ENGINE = "mooncake-transfer-engine-non-cuda"
# Mooncake's own log lines at engine start: the protocol the release asked for (0.5.12 and older
# hard-code "rdma"; MOONCAKE_PROTOCOL=tcp is read from 0.5.13), and the transport it installed
REQUESTED = re.compile(r"for protocol: (\w+)")
TRANSPORT = re.compile(r"(\w+)Transport: listen")
NO_RDMA = "No RDMA devices found"


def backend_from_logs(logs: list[Path]) -> str:
    """The transfer backend as the servers' logs show it, e.g. "mooncake (protocol rdma requested, no
    RDMA device: tcp transport; ...)"; "unknown" parts where a log lacks the line."""
    text = "\n".join(path.read_text(errors="replace") for path in logs if path.is_file())
    requested = sorted(set(REQUESTED.findall(text))) or ["unknown"]
    transports = sorted({t.lower() for t in TRANSPORT.findall(text)}) or ["unknown"]
    used = "/".join(transports)
    if requested == transports:
        return f"mooncake (protocol {used}; {ENGINE})"
    why = ", no RDMA device" if NO_RDMA in text else ""
    return f"mooncake (protocol {'/'.join(requested)} requested{why}: {used} transport; {ENGINE})"


def router_name() -> str:
    return next(line.strip() for line in ROUTER_REQUIREMENTS.read_text().splitlines()
                if line.strip() and not line.startswith("#"))


def run_scenario(item: Scenario, dep: Deployment, model: TinyModel) -> ScenarioResult:
    started = time.monotonic()
    try:
        outcome = item.run(dep, model)
        verdict, observed, details = outcome.verdict, outcome.observed, outcome.details
    except Exception as exc:  # noqa: BLE001 - a scenario that breaks is a finding about that tree, not a crash
        verdict, observed = ERROR, f"{type(exc).__name__}: {exc}"
        details = {"traceback": traceback.format_exc(limit=4)[-1500:]}
    return ScenarioResult(item.name, item.must_preserve, item.expect, verdict, observed, details,
                          round(time.monotonic() - started, 3))


def live_tree(env: ServingEnv, package_root: Path, version: str, model: TinyModel, label: str,
              workdir: Path, race: bool = True) -> LiveResult:
    log.info("live: starting prefill, decode and router for %s ...", label)
    with deployed(env, package_root, version, model, workdir) as dep:
        log.info(
            "live: %s serving after %.0f s; running %d scenarios", label, dep.startup_seconds, len(REGISTRY)
        )
        scenarios = [run_scenario(item, dep, model) for item in REGISTRY]
        startup = dep.startup_seconds
        flags = dep.flags
        backend = backend_from_logs([dep.prefill.log, dep.decode.log])
    if race:  # its own deployment (2P1D, private namespace), after the pair is stopped: one at a time
        log.info("live: %s: %s on two prefills and one decode ...", label, RACE_NAME)
        race_row = run_race(env, package_root, workdir / "2p1d", version=version)
        scenarios.append(ScenarioResult.from_json(race_row))
    server = {"version": version, "setup": flags["setup"]["name"], "flags": flags, "backend": backend,
              "router": router_name(), "model_sha256": model.sha256}
    return LiveResult(label, version, round(startup, 1), server, tuple(scenarios))


def run_live(env: ServingEnv, model: TinyModel, trees: list[tuple[str, Path, str]],
             keep_logs: Path | None = None, race: bool = True) -> list[LiveResult]:
    """`trees`: (label, package root, version). SIGTERM stops the servers as SIGINT does."""
    documents = []
    with sigterm_raises(), tempfile.TemporaryDirectory(prefix="live-", dir=cache.work_root()) as tmp:
        for index, (label, root, version) in enumerate(trees):
            workdir = (keep_logs or Path(tmp)) / f"{index}-{version}"
            documents.append(live_tree(env, root, version, model, label, workdir, race))
    return documents
