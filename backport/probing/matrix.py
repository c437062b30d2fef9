"""Probe many trees at once: one probe interpreter imports the shared third-party modules once and
forks a child per tree (`probes/runtime/matrix.py`), trees in parallel up to the core count.

Each tree's document is exactly what `run_harness` returns for it (same cases, same details;
only `import_seconds` is smaller, since the shared modules were imported before the fork).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from backport import cache
from backport.errors import Finding
from backport.probing.harness import (
    absolute_interpreter,
    check_package_root,
    launch,
    probe_environ,
    read_document,
    scrub_package_path,
)
from backport.probing.supervise import supervise

log = logging.getLogger("backport.probing")


def default_jobs() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class _Watch:
    """Progress of a probe matrix: a line as each tree finishes (its document is complete JSON),
    and one at least every 10 s naming the trees still running."""

    def __init__(self, out: Path, labels: list[str], every: float = 10.0):
        self.out, self.labels, self.every = out, labels, every
        self.done: set[int] = set()
        self.last = 0.0
        self.seconds = 0.0

    def _finished(self, index: int) -> bool:
        try:
            json.loads((self.out / f"{index}.json").read_text())
            return True
        except (OSError, ValueError):
            return False

    def __call__(self, seconds: float | None) -> None:
        self.seconds = self.seconds if seconds is None else seconds
        total = len(self.labels)
        for index, label in enumerate(self.labels):
            if index not in self.done and self._finished(index):
                self.done.add(index)
                self.last = self.seconds
                log.info(
                    "      probed %s (%d of %d trees) at %.0f s", label, len(self.done), total, self.seconds
                )
        if seconds is not None and seconds - self.last >= self.every:
            self.last = seconds
            started = [label for i, label in enumerate(self.labels)
                       if i not in self.done and (self.out / f"{i}.json").exists()]
            doing = (f"running: {', '.join(started)}" if started
                     else "importing the shared third-party modules once")
            log.info(
                "      probe matrix: %d of %d trees done, %.0f s; %s", len(self.done), total, seconds, doing
            )


def run_matrix(python: str, package_roots: list[Path], probes: list[str] | None = None, *,
               jobs: int | None = None, labels: list[str] | None = None,
               coverage: list[str] | None = None, versions: list[str] | None = None) -> list[dict]:
    """The harness document of every tree, in the order given (a tree given twice is probed once).

    `coverage`: files (relative to each tree) whose executed lines each document records.
    `versions`: the version the toolkit decided for each tree, which its probes read (an upstream
    checkout's own `sglang.version` says 0.0.0.dev0 without a generated `_version.py`).
    """
    roots = [check_package_root(root) for root in package_roots]
    unique = list(dict.fromkeys(roots))
    jobs = jobs or default_jobs()
    log.info("probing %d tree(s), %d at a time: %s", len(unique), jobs,
             ", ".join(labels or [str(r) for r in unique]))
    with tempfile.TemporaryDirectory(prefix="sglang-backport-probes-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        python = absolute_interpreter(python)
        cmd = [*launch(python, "matrix"), "--jobs", str(jobs), "--out", str(out),
               "--bytecode", str(cache.cache_root() / "bytecode")]
        decided = dict(zip(roots, versions or [], strict=False))
        for root in unique:
            cmd += ["--tree", str(root)]
        if versions:
            for root in unique:
                cmd += ["--version", decided.get(root) or "unknown"]
        for name in probes or []:
            cmd += ["--probe", name]
        for rel in coverage or []:
            cmd += ["--coverage", rel]
        names: dict[Path, str] = {}
        for root, label in zip(roots, labels or [str(r) for r in roots]):
            names.setdefault(root, label)
        watch = _Watch(out, [names[root] for root in unique])
        code = supervise(
            cmd,
            env=probe_environ(python, None),
            cwd=tmp,
            stdout=Path(tmp) / "matrix.out",
            stderr=Path(tmp) / "matrix.err",
            tick=watch,
        )
        watch(None)
        if code != 0:
            tail = "\n".join((Path(tmp) / "matrix.err").read_text(errors="replace").strip().splitlines()[-8:])
            raise Finding(f"probe matrix exited {code}:\n{tail}")
        summary = json.loads((Path(tmp) / "matrix.out").read_text().strip().splitlines()[-1])
        documents = {}
        for index, root in enumerate(unique):
            text = (out / f"{index}.json").read_text() if (out / f"{index}.json").exists() else ""
            stderr = (
                (out / f"{index}.log").read_text(errors="replace") if (out / f"{index}.log").exists() else ""
            )
            documents[root] = read_document(
                scrub_package_path(text), stderr, summary["exit_codes"][index], root
            )
    log.info("      shared imports once: %.1f s", summary["preload_seconds"])
    slowest = sorted(zip(summary["seconds"], (names[r] for r in unique)), reverse=True)[:3]
    log.info("      trees took %.1f s in all; slowest: %s", sum(summary["seconds"]),
             ", ".join(f"{label} {s:.1f} s" for s, label in slowest))
    return [documents[root] for root in roots]
