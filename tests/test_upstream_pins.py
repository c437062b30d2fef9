"""Upstream test files pinned by sha256 in fixes.toml: every download and every cache hit checked
against the pin, a wrong server's content refused, ad-hoc files recorded as unpinned, and
`upstream-tests --print-pins`. A real HTTP server on 127.0.0.1 plays the raw-file server; each
test has its own empty cache (never the shared test cache, whose upstream-tests/ holds fixtures).
"""

from __future__ import annotations

import hashlib
import json
import textwrap

import pytest

from backport import cli
from backport.errors import BadInput
from backport.pack import load_pack
from backport.upstream import Fetcher, TestRef, load_refs, run_upstream_tests
from tests import test_upstream_tests as shared
from tests.test_upstream_tests import BEHAVIOUR, PATCH, PYTHON, REV, UNIT, cache_files

# the local raw-file server, the synthetic trees and a fresh cache per test (never the shared one)
server, trees, cache_dir, closed_port_url = (
    shared.server,
    shared.trees,
    shared.cache_dir,
    shared.closed_port_url,
)

PATH = f"{UNIT}/test_admission_behaviour.py"
GOOD = hashlib.sha256(BEHAVIOUR.encode()).hexdigest()
WRONG = BEHAVIOUR.replace("assertFalse", "assertTrue")  # a mirror serving another file under the same name


def pinned_series(root, pin: str | None = GOOD, extra: str = ""):
    (root / "pr38935").mkdir(parents=True)
    (root / "pr38935" / "pr38935-0.5.19.patch").write_text(PATCH)
    (root / "series").write_text("pr38935\n")
    sha = f', sha256 = "{pin}"' if pin is not None else ""
    (root / "fixes.toml").write_text(textwrap.dedent(f'''\
        [[fix]]
        id = "pr38935"
        title = "Do not admit intake-rejected requests to a PD handoff"
        pr = 38935
        upstream_commit = "3f8eb35ead"
        upstream_tests = [
          {{ path = "{PATH}", rev = "{REV}"{sha} }},{extra}
        ]
        '''))
    return root


def test_the_shipped_pack_pins_every_listed_test_file():
    # Each pin was measured from the file's bytes at its revision (README, "Upstream tests"): a
    # file whose bytes could not be read is not listed at all, never listed with an invented pin.
    refs = load_refs()
    assert refs and all(ref.pinned and len(ref.sha256) == 64 and len(ref.rev) == 40 for ref in refs)
    admission = next(r for r in refs if r.path.endswith("test_admission_abort_not_enqueued.py"))
    assert (admission.rev, admission.sha256) == ("8f3d6944b76c428d884582cb6c82a39db1465360",
                                                 "3c7e68c2d72229f575720b4045d5f9d22d63721d2d271ee7d34522bf7ff53fcc")


@pytest.mark.parametrize("pin, message", [
    ("abc", "is not 64 lowercase hex digits"),
    (GOOD.upper(), "is not 64 lowercase hex digits"),
    ("", "is not 64 lowercase hex digits"),
])
def test_the_loader_validates_a_pin(tmp_path, pin, message):
    series = pinned_series(tmp_path / "patches", pin)
    with pytest.raises(BadInput, match=message) as caught:
        load_pack(series)
    assert PATH in str(caught.value) and "--print-pins" in str(caught.value)


def test_the_loader_refuses_two_pins_for_one_file(tmp_path):
    other = "0" * 64
    series = pinned_series(
        tmp_path / "patches", extra=f'\n  {{ path = "{PATH}", rev = "{REV}", sha256 = "{other}" }},'
    )
    (series / "fixes.toml").write_text((series / "fixes.toml").read_text() + textwrap.dedent(f'''
        [[fix]]
        id = "pr36988"
        title = "Retire aborted disaggregated prefill results"
        pr = 36988
        upstream_commit = "febb360519"
        upstream_tests = [{{ path = "{PATH}", rev = "{REV}", sha256 = "{other}" }}]
        '''))
    (series / "series").write_text("pr36988\npr38935\n")
    with pytest.raises(BadInput, match="is pinned to"):
        load_refs(series)


def test_a_pinned_file_runs_and_is_recorded_pinned(server, trees, tmp_path, cache_dir):
    server.put(PATH, BEHAVIOUR)
    refs = load_refs(pinned_series(tmp_path / "patches"))
    assert refs[0].sha256 == GOOD
    document = run_upstream_tests([("patched", trees["patched"])], refs, python=PYTHON, base_url=server.url)
    assert document["skipped"] is None
    (entry,) = document["files"]
    assert (entry["sha256"], entry["pin"], entry["error"]) == (GOOD, GOOD, None)
    assert {t["outcome"] for t in document["trees"][0]["tests"]} == {"passed", "skipped"}
    # Kept by its pin: content-addressed, whichever server served it.
    assert cache_files(cache_dir) == [f"sha256/{GOOD}/test_admission_behaviour.py",
                                      f"sha256/{GOOD}/test_admission_behaviour.py.sha256"]
    # A cache hit is checked against the pin and needs no server.
    again = Fetcher(server.url).fetch(refs[0])
    assert (again.source, again.sha256, again.data) == ("cache", GOOD, BEHAVIOUR.encode())


def test_a_wrong_servers_download_is_refused(server, trees, tmp_path, cache_dir):
    server.put(PATH, WRONG)
    series = pinned_series(tmp_path / "patches")
    (ref,) = load_refs(series)
    fetched = Fetcher(server.url).fetch(ref)
    got = hashlib.sha256(WRONG.encode()).hexdigest()
    assert fetched.data is None
    for part in (PATH, REV, GOOD, got, server.url, "refusing"):
        assert part in fetched.refused, part
    assert fetched.sha256 == got and not fetched.pinned  # what was received, never called pinned
    assert cache_files(cache_dir) == []  # nothing of it kept
    document = run_upstream_tests([("patched", trees["patched"])], [ref], python=PYTHON, base_url=server.url)
    (test,) = document["trees"][0]["tests"]
    assert test["outcome"] == "refused" and "does not match the pin" in test["reason"]
    assert document["files"][0]["pinned"] is False and document["files"][0]["sha256"] == got
    # Refused on first use: a finding (exit 1), and the file never ran.
    assert (
        cli.main(
            [
                "upstream-tests",
                str(trees["patched"]),
                "--series",
                str(series),
                "--base-url",
                server.url,
                "--python",
                PYTHON,
            ]
        )
        == 1
    )
    assert cache_files(cache_dir) == []


def test_a_cache_hit_that_does_not_match_its_pin_is_refused(server, tmp_path, cache_dir, closed_port_url):
    (ref,) = load_refs(pinned_series(tmp_path / "patches"))
    # A wrong copy in the pinned entry, with a sidecar that agrees with it (what a first-copy-trusted
    # cache would have kept from a wrong mirror).
    file, sidecar = Fetcher(server.url).cache_paths(ref)
    file.parent.mkdir(parents=True)
    file.write_text(WRONG)
    sidecar.write_text(f"{hashlib.sha256(WRONG.encode()).hexdigest()}  {file.name}\n")
    offline = Fetcher(closed_port_url).fetch(ref)
    assert offline.data is None and "not the pin" in offline.refused and GOOD in offline.refused
    assert "unreachable" in offline.refused
    # Online, the genuine file replaces it.
    server.put(PATH, BEHAVIOUR)
    online = Fetcher(server.url).fetch(ref)
    assert online.refused is None and online.data == BEHAVIOUR.encode() and online.pinned
    assert file.read_text() == BEHAVIOUR


def test_old_and_other_servers_cache_entries_are_never_trusted(server, tmp_path, cache_dir, closed_port_url):
    # The layout before pins (`<rev>/<path>`, first copy trusted) and another server's unpinned copy.
    legacy = cache_dir / REV / PATH
    legacy.parent.mkdir(parents=True)
    legacy.write_text(WRONG)
    (legacy.parent / (legacy.name + ".sha256")).write_text(hashlib.sha256(WRONG.encode()).hexdigest() + "\n")
    mirror = Fetcher(f"{server.url}/mirror")
    server.put(PATH, WRONG, rev=f"mirror/{REV}")
    assert mirror.fetch(TestRef(PATH, REV)).data == WRONG.encode()
    # The genuine server's file is not refused because a mirror served something else first...
    server.put(PATH, BEHAVIOUR)
    genuine = Fetcher(server.url).fetch(TestRef(PATH, REV))
    assert genuine.error is None and genuine.data == BEHAVIOUR.encode()
    # ...and offline, neither copy stands in for a third server.
    assert Fetcher(closed_port_url).fetch(TestRef(PATH, REV)).unavailable


def test_an_ad_hoc_test_is_recorded_unpinned(server, trees, tmp_path, capsys):
    server.put(PATH, BEHAVIOUR)
    series = pinned_series(tmp_path / "patches")
    argv = ["upstream-tests", str(trees["patched"]), "--series", str(series), "--test", PATH, "--rev", REV,
            "--base-url", server.url, "--python", PYTHON]
    assert cli.main([*argv, "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["files"]
    assert (entry["sha256"], entry["pin"]) == (GOOD, None)
    assert cli.main(argv) == 0
    assert f"{PATH}@{REV[:12]}: sha256 {GOOD} (unpinned, from {server.url}" in capsys.readouterr().out


def test_print_pins_measures_without_running_or_writing(server, tmp_path, cache_dir, capsys):
    server.put(PATH, BEHAVIOUR)
    series = pinned_series(tmp_path / "patches", pin=None)
    before = (series / "fixes.toml").read_bytes()
    assert (
        cli.main(["upstream-tests", "--print-pins", "--series", str(series), "--base-url", server.url]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("# pr38935: upstream_tests = [")
    assert f'{{ path = "{PATH}", rev = "{REV}", sha256 = "{GOOD}" }},' in out
    assert (series / "fixes.toml").read_bytes() == before and cache_files(cache_dir) == []
    assert cli.main(["upstream-tests", "--print-pins", "--series", str(series), "--base-url", server.url,
                     "--json"]) == 0
    (pin,) = json.loads(capsys.readouterr().out)["pins"]
    assert (pin["sha256"], pin["pinned"], pin["fix"]) == (GOOD, None, "pr38935")
    # The printed line, pasted into fixes.toml, is a pin the loader accepts and the fetcher honours.
    pinned = pinned_series(tmp_path / "pasted", pin=pin["sha256"])
    assert load_refs(pinned)[0].sha256 == GOOD


def test_print_pins_refuses_a_file_that_contradicts_its_pin_or_cannot_be_reached(
    server, tmp_path, closed_port_url, capsys
):
    server.put(PATH, WRONG)
    series = pinned_series(tmp_path / "patches")
    assert cli.main(["upstream-tests", "--print-pins", "--series", str(series), "--base-url", server.url,
                     "--json"]) == 2
    assert "does not match the pin" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert (
        cli.main(["upstream-tests", "--print-pins", "--series", str(series), "--base-url", closed_port_url])
        == 2
    )
    assert "unreachable" in capsys.readouterr().err
    assert cli.main(["upstream-tests", "--series", str(series)]) == 2
    assert "at least one TREE" in capsys.readouterr().err
