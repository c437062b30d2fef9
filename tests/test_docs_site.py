"""The docs site: generated reference pages are current, `mkdocs build --strict` passes, and
README's links point at files that exist (docs/development.md, "The docs site")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import docsgen

REPO = Path(__file__).resolve().parent.parent


def test_generated_pages_are_current():
    stale = docsgen.stale(docsgen.render())
    assert not stale, (
        f"stale generated pages {stale}: run .venv/bin/python -m tools.docsgen and commit docs/generated/"
    )


def test_cli_reference_names_every_command_and_option():
    """The CLI page comes from the real parser: each subcommand is a section with each of its options."""
    import argparse

    from backport.cli import build_parser

    page = docsgen.cli_page()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, cmd in sub.choices.items():
        section = page.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in cmd._actions:
            if isinstance(action, argparse._HelpAction):  # every command's -h, said once above
                continue
            for option in action.option_strings:
                assert f"`{option}`" in section, f"{name}: {option} missing from the CLI reference"


def test_bundle_page_names_the_written_format():
    from backport.evidence import formats

    page = docsgen.bundle_page()
    assert f"written by this toolkit: **{formats.current()}**" in page
    assert "`predicate.schema_version`" in page


def test_generator_check_mode_names_a_stale_page(tmp_path, monkeypatch):
    monkeypatch.setattr(docsgen, "OUT", tmp_path)
    assert docsgen.main([]) == 0 and docsgen.main(["--check"]) == 0
    (tmp_path / "cli.md").write_text("old\n")
    assert docsgen.main(["--check"]) == 1


MKDOCS = Path(sys.executable).parent / "mkdocs"


@pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs not installed (the test extra)")
def test_mkdocs_build_strict(tmp_path):
    """No broken link or anchor, no page outside the nav (mkdocs.yml's validation, as errors)."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [str(MKDOCS), "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        check=False, cwd=REPO, capture_output=True, text=True, env=env, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "generated" / "cli" / "index.html").is_file()


def test_readme_links_exist():
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert targets, "README links nowhere"
    missing = [t for t in targets if not t.startswith(("http://", "https://")) and not (REPO / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
