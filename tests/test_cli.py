"""The CLI contract: exit 2 with one line (one JSON document with --json) for every bad input,
checked before anything is downloaded or built; no traceback reaches a user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backport.cli import main
from backport.evidence.layout import MARKER, MARKER_BYTES

RELEASE_FILES = {
    "myapp-1.0.tar.gz": b"\x1f\x8b\x08 a tarball",
    "SHA256SUMS": b"%s  myapp-1.0.tar.gz\n" % (b"0" * 64),
}
SGLANG_TREE_FILES = {"sglang/__init__.py": "", "sglang/version.py": "__version__ = '9.9.9'\n"}


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


BAD = {
    # name: argv (every reporting command at least once; `{tmp}` is a fresh directory)
    "fetch-not-a-spec": ["fetch", "numpy>=1"],
    "fetch-unpinned": ["fetch", "sglang==9.9.9"],
    "status-missing-path": ["status", "{tmp}/nope"],
    "apply-no-series": ["apply", "{tmp}/tree", "--series", "{tmp}/no-pack"],
    "apply-out-is-a-file": ["apply", "sglang==0.5.19", "--out", "{tmp}/file"],
    "env-bad-python": ["env", "--python", "{tmp}/no-python"],
    "probe-missing-tree": ["probe", "{tmp}/nonexistent"],
    "probe-unknown-probe": ["probe", "{tmp}/tree", "--probe", "no_such_probe"],
    "run-unpinned": ["run", "sglang==9.9.9"],
    "run-version-typo": ["run", "sglang==0.5.91"],
    "run-version-newer-than-the-matrix": ["run", "sglang==9.0.1"],
    "run-version-below-the-range": ["run", "sglang==0.4.5"],
    "run-path-without-sglang": ["run", "{tmp}/release"],
    "run-bad-reference": ["run", "sglang==0.5.19", "--reference", "sglang==9.9.9"],
    "run-no-series": ["run", "sglang==0.5.19", "--series", "{tmp}/no-pack"],
    "run-out-is-a-file": ["run", "sglang==0.5.19", "--out", "{tmp}/file"],
    "run-out-holds-someones-sha256sums": ["run", "sglang==0.5.19", "--out", "{tmp}/release"],
    "run-out-holds-someones-sha256sums-force": ["run", "sglang==0.5.19", "--out", "{tmp}/release", "--force"],
    "run-out-holds-a-bundle": ["run", "sglang==0.5.19", "--out", "{tmp}/bundle"],
    "verify-missing": ["verify", "{tmp}/no-bundle"],
    "verify-not-a-bundle": ["verify", "{tmp}/release"],
    "upstream-tests-missing": ["upstream-tests", "{tmp}/nope"],
    "gc-negative": ["gc", "--older-than", "-3"],
    "usage-unknown-command": ["frobnicate"],
    "usage-missing-argument": ["fetch"],
    "usage-unknown-flag": ["status", "x", "--colour"],
}


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SGLANG_BACKPORT_PROBE_PYTHON", raising=False)
    for name, text in SGLANG_TREE_FILES.items():
        path = tmp_path / "tree" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "file").write_text("not a directory\n")
    # someone's release folder, which a bundle must never replace
    (tmp_path / "release").mkdir()
    for name, data in RELEASE_FILES.items():
        (tmp_path / "release" / name).write_bytes(data)
    # a bundle the toolkit wrote (its marker and a receipt): replaced only with --force
    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / MARKER).write_bytes(MARKER_BYTES)
    (tmp_path / "bundle" / "receipt.json").write_text("{}\n")
    return tmp_path


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_bad_input_is_exit_2_and_one_line(case, as_json, workspace, capsys):
    argv = [a.replace("{tmp}", str(workspace)) for a in BAD[case]] + (["--json"] if as_json else [])
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert one_error_line(err).startswith("sglang-backport: error: ")
    if as_json:
        assert json.loads(out)["error"]["code"] == 2 and json.loads(out)["error"]["message"]
    else:
        assert out == ""
    # refused before anything heavy: no probe environment, no download
    assert not (workspace / "cache" / "envs").exists()
    assert not (workspace / "cache" / "wheels").exists()
    # and nothing of the user's changed
    assert {p.name: p.read_bytes() for p in (workspace / "release").iterdir()} == RELEASE_FILES
    assert sorted(p.name for p in (workspace / "bundle").iterdir()) == sorted([MARKER, "receipt.json"])


def test_a_closed_pipe_ends_quietly(workspace):
    env = {**os.environ, "SGLANG_BACKPORT_CACHE": str(workspace / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "backport.cli", "status", str(workspace / "tree"), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # the reader went away before anything was written (`| head -0`)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_internal_errors_are_one_line(workspace, monkeypatch, capsys):
    from backport.cli import trees

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(trees, "cmd_gc", broken)
    code = main(["gc", "--json"])
    out, err = capsys.readouterr()
    assert code == 1 and "internal error: RuntimeError: a bug" in one_error_line(err)
    assert json.loads(out)["error"]["code"] == 1


def _newest_pinned():
    from packaging.version import Version

    from backport.releases import load_pins

    return max(load_pins(), key=Version)


NEWEST = _newest_pinned()
NEWER = ".".join(NEWEST.split(".")[:2] + [str(int(NEWEST.split(".")[2]) + 1)])


@pytest.mark.parametrize(
    "version, says",
    [
        ("0.5.91", "did you mean sglang==0.5.19?"),
        ("0.5.16.post1", "did you mean sglang==0.5.16?"),
        (
            NEWER,
            (
                f"newer than the release matrix (newest pinned: {NEWEST}): it ships every upstream fix this "
                "pack "
                "carries, so only this pack's own check (sbp-transfer-coverage) applies"
            ),
        ),
        ("0.4.4.post2", f"below the supported range (0.4.5.post1 - {NEWEST})"),
    ],
)
def test_version_mistakes_are_answered_precisely(version, says, workspace, capsys):
    assert main(["fetch", f"sglang=={version}"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert says in line
    # a typo is not steered to an unverified download; the other two name it last, as the way to go on anyway
    assert (
        ("--allow-unpinned" not in line) if "did you mean" in says else line.endswith("pass --allow-unpinned")
    )


def test_run_of_a_path_without_sglang_is_refused_before_the_environment_build(workspace, capsys):
    assert main(["run", "/etc"]) == 2
    assert "not an SGLang tree" in one_error_line(capsys.readouterr().err)
    assert not (workspace / "cache" / "envs").exists()


def test_bad_input_corpus_size():
    """docs/development.md counts this corpus; keep the number there in step."""
    development = (Path(__file__).resolve().parent.parent / "docs" / "development.md").read_text()
    assert f"{len(BAD)} bad-input cases" in development


def _subcommands():
    import argparse

    from backport.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


@pytest.mark.parametrize("command", list(_subcommands()))
def test_readme_cli_table_lists_every_flag_help_shows(command):
    """Each subcommand has one row in README's CLI table, and that row names every flag its --help shows."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("\n## CLI\n", 1)[1].split("\nExit codes:", 1)[0]
    heads = (f"| `sglang-backport {command} ", f"| `sglang-backport {command}`")
    rows = [line for line in table.splitlines() if line.startswith(heads)]
    assert len(rows) == 1, f"README's CLI table has {len(rows)} rows for {command}"
    shown = _subcommands()[command].format_help()
    flags = {option for action in _subcommands()[command]._actions for option in action.option_strings
             if option.startswith("--") and option != "--help"}
    assert flags, command
    for flag in sorted(flags):
        assert flag in shown  # what --help prints
        assert f"[{flag}" in rows[0] or f" {flag} " in rows[0], f"README's row for {command} lacks {flag}"
