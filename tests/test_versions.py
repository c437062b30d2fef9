"""Versions: the toolkit's (one place, printed by --version, in CHANGELOG.md) and the bundle
format's (the receipt schema's `$id`), and verify's compatibility rule on real older bundles."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from backport import __version__
from backport.cli import main
from backport.evidence import formats
from tests.test_evidence import _rewrite, evidence, fixture_run

REPO = Path(__file__).resolve().parent.parent


def test_the_version_is_written_once_and_printed(capsys):
    written = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert __version__ == version("sglang-backport") == written  # (reinstall after a bump: the metadata)
    done = subprocess.run([sys.executable, "-m", "backport", "--version"], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == f"sglang-backport {written}"


def test_the_changelog_names_this_version_first():
    text = (REPO / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert releases[:2] == ["Unreleased", __version__], releases
    assert re.search(rf"^## \[{re.escape(__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.MULTILINE)
    assert f"bundle format {formats.current()}" in text.lower()


def test_the_receipt_schema_id_carries_the_format_it_checks():
    schema = json.loads((REPO / "evidence" / "receipt.schema.json").read_text())
    assert schema["$id"] == f"https://sglang-backport.dev/receipt/format/{formats.current()}/schema.json"
    assert schema["properties"]["predicate"]["properties"]["schema_version"] == {"const": formats.current()}


def test_every_older_format_is_read_or_its_reader_named():
    older = set(range(1, formats.current()))
    assert older == set(formats.ALSO_READ) | set(formats.OLDER_READERS)
    assert not set(formats.ALSO_READ) & set(formats.OLDER_READERS)


def _bundle_of(commit: str, tmp: Path) -> Path:
    """A bundle written by the toolkit of COMMIT (its own code, from git, on its own test fixture),
    after that toolkit's verify has accepted it: proof that the commit named reads the format."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=False)
    if archive.returncode != 0:
        pytest.skip(f"commit {commit} is not in this checkout's history")
    source = tmp / "source"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(source, filter="data")
    script = (
        "import sys; from pathlib import Path; sys.path.insert(0, '.'); "
        "from backport import evidence; from tests.test_evidence import fixture_run; "
        "b = evidence.write_bundle(Path(sys.argv[1]) / 'bundle', fixture_run(Path(sys.argv[1]) / 'run')); "
        "assert evidence.verify(b).ok; print(b)"
    )
    # -P: the old source tree, not the installed package, is the `backport` imported
    done = subprocess.run([sys.executable, "-P", "-c", script, str(tmp / "old")], cwd=source,
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return Path(done.stdout.strip())


# what the one line says this toolkit reads: "format 4", or "formats 3, 4" while it reads format 3 too
_READS = "format" + ("s " if len(formats.readable()) > 1 else " ") + ", ".join(map(str, formats.readable()))


@pytest.mark.parametrize("old_format", sorted(formats.OLDER_READERS))
def test_verify_names_the_toolkit_that_reads_an_older_format(old_format, tmp_path, capsys):
    commit, old_version = formats.OLDER_READERS[old_format]
    bundle = _bundle_of(commit, tmp_path)
    assert json.loads((bundle / "receipt.json").read_text())["predicate"]["schema_version"] == old_format
    assert main(["verify", str(bundle)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"sglang-backport: error: {bundle}: bundle format {old_format}, written by sglang-backport "
        f"{old_version}; sglang-backport {__version__} reads {_READS}: verify it with "
        f"sglang-backport {old_version} as of commit {commit}, the last that reads format {old_format}"
    )


def test_verify_sends_a_newer_format_to_a_newer_toolkit(tmp_path, capsys):
    bundle = evidence.write_bundle(tmp_path / "bundle", fixture_run(tmp_path / "run"))
    assert main(["verify", str(bundle)]) == 0  # this format verifies
    capsys.readouterr()
    newer = formats.current() + 1
    _rewrite(bundle, lambda s: s["predicate"].update(schema_version=newer))
    assert main(["verify", "--json", str(bundle)]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["code"] == 2
    assert err.count("\n") == 1 and f"bundle format {newer}, written by sglang-backport " in err
    assert err.rstrip().endswith(
        f"reads {_READS}: verify it with the release that wrote it or a newer one"
    )
