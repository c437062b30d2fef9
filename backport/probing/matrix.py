"""Probe many trees at once: one probe interpreter imports the shared third-party modules once and
forks a child per tree (`probes/matrix.py`), trees in parallel up to the core count.

Each tree's document is exactly what `run_harness` returns for it (same cases, same details;
only `import_seconds` is smaller, since the shared modules were imported before the fork).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from pathlib import Path

from backport.errors import Finding
from backport.probing.harness import (
    absolute_interpreter,
    check_package_root,
    link_probes,
    probe_environ,
    read_document,
)

log = logging.getLogger("backport.probing")


def default_jobs() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def run_matrix(python: str, package_roots: list[Path], probes: list[str] | None = None, *,
               jobs: int | None = None, labels: list[str] | None = None,
               coverage: list[str] | None = None) -> list[dict]:
    """The harness document of every tree, in the order given (a tree given twice is probed once).

    `coverage`: files (relative to each tree) whose executed lines each document records.
    """
    roots = [check_package_root(root) for root in package_roots]
    unique = list(dict.fromkeys(roots))
    jobs = jobs or default_jobs()
    log.info("probing %d tree(s), %d at a time: %s", len(unique), jobs,
             ", ".join(labels or [str(r) for r in unique]))
    with tempfile.TemporaryDirectory(prefix="sglang-backport-probes-") as tmp:
        link_probes(Path(tmp))
        out = Path(tmp) / "out"
        out.mkdir()
        python = absolute_interpreter(python)
        cmd = [python, "-m", "probes.matrix", "--jobs", str(jobs), "--out", str(out)]
        for root in unique:
            cmd += ["--tree", str(root)]
        for name in probes or []:
            cmd += ["--probe", name]
        for rel in coverage or []:
            cmd += ["--coverage", rel]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                              env=probe_environ(python, None, Path(tmp)), cwd=tmp)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
            raise Finding(f"probe matrix exited {proc.returncode}:\n{tail}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        link = str(Path(tmp) / "probes")
        documents = {}
        for index, root in enumerate(unique):
            text = (out / f"{index}.json").read_text() if (out / f"{index}.json").exists() else ""
            stderr = (out / f"{index}.log").read_text(errors="replace") if (out / f"{index}.log").exists() else ""
            documents[root] = read_document(text.replace(link, "probes"), stderr, summary["exit_codes"][index], root)
    log.info("      shared imports once: %.1f s", summary["preload_seconds"])
    return [documents[root] for root in roots]
