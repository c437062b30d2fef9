"""Start-up: `--help`, `--version` and bad input import none of the heavy libraries.

Asserted on the modules `python -X importtime` lists, not on time (benchmarks/bench_startup.py
measures the CPU seconds). The heavy ones cost seconds between them: jsonschema's format checker
imports rfc3987_syntax, which compiles a grammar; cyclonedx, securesystemslib and requests pull
large trees; torch is the probe environment's, never the toolkit's.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from backport.evidence import jsonschemas

HEAVY = ("jsonschema", "rfc3987_syntax", "lark", "cyclonedx", "securesystemslib", "requests", "torch")

LIGHT_COMMANDS = {
    "help": (["--help"], 0),
    "version": (["--version"], 0),
    "unknown-command": (["frobnicate"], 2),
    "unknown-flag": (["status", "x", "--colour"], 2),
    "missing-argument": (["verify"], 2),
    "verify-missing-bundle": (["verify", "/nonexistent/bundle"], 2),
    "subcommand-help": (["run", "--help"], 0),
    "upstream-tests-help": (["upstream-tests", "--help"], 0),
}


def imported_modules(argv: list[str], code: int) -> tuple[set[str], str]:
    """The modules a `python -m backport ARGV` imports (top-level names), and its stdout."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "backport", *argv],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    names = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    assert "backport" in names, done.stderr[-2000:]  # importtime did list the imports
    return names, done.stdout


@pytest.mark.parametrize("name", sorted(LIGHT_COMMANDS))
def test_light_commands_import_no_heavy_library(name):
    argv, code = LIGHT_COMMANDS[name]
    names, _ = imported_modules(argv, code)
    assert not names & set(HEAVY), sorted(names & set(HEAVY))


def test_a_command_that_validates_still_imports_jsonschema_without_the_grammar():
    """The heavy imports moved, they did not vanish: loading the checker imports jsonschema, and
    not the rfc3987 grammar."""
    script = ("import sys; from backport.evidence import jsonschemas; jsonschemas.load(); "
              "print(sorted(m for m in ('jsonschema', 'rfc3987_syntax', 'lark') if m in sys.modules))")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["['jsonschema']"]


@pytest.mark.parametrize("value, iri, reference", [
    ("https://github.com/sgl-project/sglang/pull/36988", True, True),
    ("urn:sglang-backport:tree:dirHash1:" + "ab" * 32, True, True),
    ("https://例え.jp/パス?q=%E2%9C%93", True, True),  # an IRI: non-ASCII allowed
    ("../relative/path#frag", False, True),
    ("https://example.com/a b", False, False),       # a space
    ("https://example.com/<x>", False, False),
    ("https://example.com/100%", False, False),      # a % that is no escape
    ("1http://example.com", False, True),             # not a scheme: a relative reference
])
def test_the_iri_checks_that_replace_the_grammar(value, iri, reference):
    jsonschema = jsonschemas.load()
    for validator in (jsonschema.Draft7Validator, jsonschema.Draft202012Validator):
        assert validator.FORMAT_CHECKER.conforms(value, "iri") is iri
        assert validator.FORMAT_CHECKER.conforms(value, "iri-reference") is reference


def test_strict_cyclonedx_still_rejects_a_url_with_a_space():
    """CycloneDX 1.6 gives its URLs the iri-reference format: the check still reaches its validator."""
    from backport.evidence.cyclonedx import validation_error

    def bom(url: str) -> str:
        return ('{"bomFormat": "CycloneDX", "specVersion": "1.6", "version": 1, '
                f'"externalReferences": [{{"type": "website", "url": "{url}"}}]}}')

    assert validation_error(bom("https://github.com/sgl-project/sglang")) is None
    error = validation_error(bom("https://github.com/sgl project")) or ""
    assert "is not valid" in error and "'format': 'iri-reference'" in error


def test_upstream_tests_help_names_the_upstream_defaults():
    """cli/upstream.py states the defaults without importing backport.upstream: held to its constants."""
    from backport import upstream
    from backport.cli import upstream as cli_upstream

    assert (cli_upstream.BASE_URL_ENV, cli_upstream.DEFAULT_BASE_URL) == (upstream.BASE_URL_ENV,
                                                                          upstream.DEFAULT_BASE_URL)
    _, out = imported_modules(["upstream-tests", "--help"], 0)
    assert upstream.DEFAULT_BASE_URL in " ".join(out.split())
