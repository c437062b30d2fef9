"""nox sessions: tests, lint, bench, and one `pair` session per release and upstream pair.

Release pairs come from the release matrix (patches/releases.toml: every release the pack
changes, against its backport); upstream's own before/after pairs from patches/pairs.toml.

    nox -l                            list the sessions
    nox -s tests                      the test suite (extra pytest arguments after --)
    nox -s "pair(name='0.5.19')"      one evidence bundle: sglang 0.5.19 against its backport
    nox -s pair -- --no-upstream-tests   every pair; arguments after -- go to `sglang-backport run`
    nox -s matrix                     every release at once, one probe matrix (the fast way)
    nox -s fanout -- 3                the CI workflow's steps locally: shard 3 of `matrix --json`, signed
                                      with a throwaway key, then the fan-in (verify, merge)

Pair sessions with git targets need the upstream repository (`{upstream}` in pairs.toml,
overridden by SGLANG_BACKPORT_UPSTREAM_GIT); when it cannot be reached they skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from backport.releases import load_releases  # the matrix is the one list of releases

PAIRS_FILE = ROOT / "patches" / "pairs.toml"
UPSTREAM_ENV = "SGLANG_BACKPORT_UPSTREAM_GIT"

# plain `nox` runs the quick check only; the test suite (about 25 minutes) is `nox -s tests`
nox.options.sessions = ["lint"]
nox.options.reuse_existing_virtualenvs = True


def _pairs() -> dict:
    document = tomllib.loads(PAIRS_FILE.read_text())
    upstream = os.environ.get(UPSTREAM_ENV) or document.get("upstream", "")
    pairs = {version: {"name": version, "base": f"sglang=={version}", "head": "backport", "upstream": upstream}
             for version, release in load_releases().items() if release.applies_anything}
    for entry in document.get("pair", []):
        resolved = {key: value.replace("{upstream}", upstream) if isinstance(value, str) else value
                    for key, value in entry.items()}
        resolved["upstream"] = upstream
        pairs[entry["name"]] = resolved
    return pairs


PAIRS = _pairs()


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite (set SGLANG_BACKPORT_PROBE_PYTHON to reuse a probe interpreter)."""
    session.install("-e", ".[test]")
    session.run("pytest", *(session.posargs or ["-q", "-ra"]))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff and mypy as .ci/run runs them (mypy needs the package's dependencies to read their types)."""
    session.install("-e", ".[test]")
    session.run("ruff", "check", "backport", "probes", "tests", "tools", "benchmarks")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark in benchmarks/ (each prints its own measurements)."""
    session.install("-e", ".")
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        session.run("python", str(script), *session.posargs)


def _reachable(url: str) -> str | None:
    """None when `git ls-remote` reaches the repository, else the reason it could not."""
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "true"}
    try:
        proc = subprocess.run(["git", "ls-remote", "--exit-code", url, "HEAD"], capture_output=True, text=True,
                              env=env, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return "git ls-remote timed out after 60 s"
    except OSError as exc:
        return f"cannot run git ({exc.strerror})"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"git ls-remote exited {proc.returncode}"


@nox.session
def matrix(session: nox.Session) -> None:
    """Every release the pack changes in one `run` (one bundle each, all trees in one probe matrix)."""
    session.install("-e", ".")
    session.chdir(ROOT)
    specs = [entry["base"] for entry in PAIRS.values() if entry["head"] == "backport"]
    session.run("sglang-backport", "run", *specs, *session.posargs, external=False)


@nox.session
@nox.parametrize("name", list(PAIRS), ids=[f"name={name!r}" for name in PAIRS])
def pair(session: nox.Session, name: str) -> None:
    """One base/head pair (a release against its backport, or upstream's own) through `run`, writing a bundle."""
    entry = PAIRS[name]
    specs = [entry["base"]] + ([] if entry["head"] == "backport" else [entry["head"]])
    if any(spec.startswith("git+") for spec in specs):
        url = entry["upstream"]
        why = _reachable(url)
        if why is not None:
            session.skip(f"pair {name} needs the upstream repository {url}, which cannot be reached "
                         f"({why}); offline, this pair is skipped. Set {UPSTREAM_ENV} to a reachable "
                         f"mirror or a local clone of sgl-project/sglang to run it")
    session.install("-e", ".")
    command = ["sglang-backport", "run", entry["base"]]
    if entry["head"] != "backport":
        command += ["--head", entry["head"]]
    if entry.get("out"):
        # the pair's own bundle directory: a re-run replaces it (a bundle holding anything else,
        # a signature or notes, is moved aside whole, never deleted)
        command += ["--out", str(ROOT / entry["out"]), "--force"]
    session.chdir(ROOT)
    session.run(*command, *session.posargs, external=False)


@nox.session
def fanout(session: nox.Session) -> None:
    """One shard of .github/workflows/backport-matrix.yml and its fan-in, locally: `matrix --json`,
    `run SPECS --export`, `sign` (a throwaway ed25519 key), `verify --key --require-pass` over every
    bundle, `merge --expect SPECS --fail-on finding`. As in CI, a release with a finding, a bundle
    that does not verify and an expected release without a bundle each fail the session (after the
    merge, whose summary says why per release). Arguments: the shard number (default 1) and the
    shard size (default 4)."""
    import json as _json

    number = int(session.posargs[0]) if session.posargs else 1
    size = session.posargs[1] if len(session.posargs) > 1 else "4"
    session.install("-e", ".")
    work = Path(session.create_tmp()) / "fanout"
    shutil.rmtree(work, ignore_errors=True)
    (work / "keys").mkdir(parents=True)
    shards = _json.loads(session.run("sglang-backport", "matrix", "--json", "--shard-size", size, silent=True))
    shard = shards["include"][number - 1]
    specs = shard["specs"].split()
    out = work / "all" / f"bundles-{shard['shard']}"
    # a finding (exit 1) still writes its bundle: the fan-in below judges it, as in CI
    session.run("sglang-backport", "run", *specs, "--export", "--no-upstream-tests", "--out", str(out),
                success_codes=[0, 1])
    key, public = work / "keys" / "key.pem", work / "keys" / "key.pub"
    session.run("openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key), external=True)
    session.run("openssl", "pkey", "-in", str(key), "-pubout", "-out", str(public), external=True)
    bundles = sorted(str(p.parent) for p in (work / "all").rglob("receipt.json"))
    if not bundles:
        session.error(f"shard {shard['shard']} ({shard['specs']}) left no bundle")
    for bundle in bundles:
        session.run("sglang-backport", "sign", bundle, "--key", str(key))
    verdict = _json.loads(session.run("sglang-backport", "verify", *bundles, "--key", str(public), "--require-pass",
                                      "--json", silent=True, success_codes=[0, 1]))
    failed = [f"{d['bundle']} ({d['first']['file']}: {d['first']['kind']})" if d["integrity"] != "ok"
              else f"{d['bundle']} (result {d['result']}: {d['finding']})"
              for d in verdict.get("bundles", [verdict]) if d["integrity"] != "ok" or d["result"] != "pass"]
    for line in failed:
        session.log(f"verify --require-pass: {line}")
    session.run("sglang-backport", "merge", str(work / "all"), "--out", str(work / "merged"), "--expect", *specs,
                "--fail-on", "finding")
    if failed:
        session.error(f"verify --require-pass failed for {len(failed)} bundle(s): {'; '.join(failed)}")
