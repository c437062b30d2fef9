"""The main job (`backport.job`, `sglang-backport run`): its inputs, its steps on the real 0.5.19
tree with the probe matrix stubbed, several targets at once, and the whole job for real."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backport import cli, evidence
from backport.evidence.table import attached_from
from tests.test_evidence import PASSING_CASES, D, _validate, probe_doc

REPO = Path(__file__).resolve().parent.parent


# ---- run's own inputs ------------------------------------------------------------------------------


def test_default_reference_is_first_pinned_release_with_every_upstream_fix():
    from packaging.version import Version

    from backport.job import default_reference
    from backport.pack import load_pack
    from backport.releases import load_pins

    pack = load_pack(REPO / "patches")
    upstream_fixes = [
        fix for fix in pack.fixes.values() if not fix.is_vendor
    ]  # a vendor fix is in no release
    version = default_reference(pack).removeprefix("sglang==")
    assert all(fix.is_fixed_in(version) for fix in upstream_fixes)
    older = [v for v in load_pins() if Version(v) < Version(version)
             and all(f.is_fixed_in(v) for f in upstream_fixes)]
    assert older == []
    # the floor, not the newest: a newer release with every fix (0.5.23) is a target
    assert any(Version(v) > Version(version) and all(f.is_fixed_in(v) for f in upstream_fixes)
               for v in load_pins())


def test_pairs_toml_pins_upstreams_own_pairs():
    import tomllib

    pairs = tomllib.loads((REPO / "patches" / "pairs.toml").read_text())["pair"]
    upstream = {p["name"]: p for p in pairs if p["head"] != "backport"}
    assert upstream["pr38935"]["base"].endswith("@17ba2c2e7c7b81f31a8a9e693e7435ab262c16b4")
    assert upstream["pr38935"]["head"].endswith("@8f3d6944b76c428d884582cb6c82a39db1465360")
    assert upstream["pr36988"]["base"].endswith("@9c254df8cdbe99ef5f58e7fcd932da052f258538")
    assert upstream["pr36988"]["head"].endswith("@2ee5742af92db2727236460473554c2ee8c4ddaa")


def test_nox_lists_a_session_per_release_of_the_matrix_and_per_upstream_pair():
    from backport.releases import load_releases

    nox = shutil.which("nox") or str(Path(sys.executable).parent / "nox")
    proc = subprocess.run([nox, "-l", "-f", str(REPO / "noxfile.py")], capture_output=True, text=True,
                          cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    releases = [v for v, r in load_releases().items() if r.applies_anything]
    assert "0.5.19" in releases and "0.5.10" in releases
    for name in ("tests", "lint", "bench", "matrix", "pair(name='pr38935')", "pair(name='pr36988')",
                 *(f"pair(name='{v}')" for v in releases)):
        assert name in proc.stdout, (name, proc.stdout)


# ---- `run` on the real trees, the probe matrix stubbed -----------------------------------------------


@pytest.fixture
def stub_probes(monkeypatch):
    """Stand in for the probe matrix (the real one imports SGLang per tree): fixture verdicts per role."""
    import importlib

    job_run = importlib.import_module("backport.job.run")  # the package re-exports `run`, the function
    calls: list[list[tuple[str, Path]]] = []

    def fake_matrix(
        python, package_roots, probes=None, *, jobs=None, labels=None, coverage=None, versions=None
    ):
        roles = [label.split(" ")[0] for label in labels]
        calls.append(list(zip(roles, map(Path, package_roots), strict=True)))
        return [probe_doc(Path(root), ("pristine", "patched", "reference").index(role), PASSING_CASES)
                for role, root in zip(roles, package_roots, strict=True)]

    monkeypatch.setattr(job_run, "run_matrix", fake_matrix)
    monkeypatch.setattr(job_run, "ensure_env", lambda python=None, **_: Path(sys.executable))
    return calls


@pytest.fixture
def real_cache(shared_cache, monkeypatch):
    monkeypatch.setenv("SGLANG_BACKPORT_CACHE", str(shared_cache))
    return shared_cache


# the tests below need the real 0.5.19/0.5.20/0.5.22 wheels: each is marked network itself, since a
# mid-module pytestmark would mark the whole file and hide the offline tests above from the fast subset
network = pytest.mark.network


@network
def test_run_writes_a_bundle_that_verifies(real_cache, stub_probes, tmp_path, capsys):
    out = tmp_path / "bundle"
    code = cli.main(["run", "sglang==0.5.19", "--out", str(out), "--no-upstream-tests", "--json"])
    captured = capsys.readouterr()
    document = json.loads(captured.out)  # exactly one JSON document on stdout
    assert code == 0 and document["result"] == "pass" and document["bundle"] == str(out.absolute())
    assert "[sglang==0.5.19 1/" in captured.err and "probe matrix" in captured.err
    assert evidence.verify(out).ok
    p = attached_from(out, json.loads((out / "receipt.json").read_text()))["predicate"]
    _validate(json.loads((out / "receipt.json").read_text()))
    assert [[role for role, _ in call] for call in stub_probes] == [["pristine", "patched", "reference"]]
    from backport.job import default_reference
    from backport.pack import load_pack

    assert p["inputs"]["reference"]["spec"] == default_reference(load_pack(REPO / "patches"))
    trees = p["inputs"]["trees"]
    assert trees["pristine"]["tree_digest"] != trees["patched"]["tree_digest"]
    assert trees["patched"]["commit"] == p["apply"]["head_commit"]
    assert p["apply"]["status"] == "applied" and p["apply"]["tree"] == "patched"
    for patch in p["inputs"]["patches"]:
        assert patch["sha256"] == evidence.sha256_file(REPO / "patches" / patch["path"])
    assert {s["path"] for s in p["inputs"]["series"]} >= {"series", "fixes.toml", "releases.toml"}
    assert not Path(p["timestamps"]["paths"]["patched"]).exists()  # the work clone is removed
    assert p["upstream_tests"]["skipped"] == "disabled with --no-upstream-tests"
    # the stub recorded no coverage: the receipt says so instead of claiming any
    assert p["coverage"]["measured"] is False and p["summary"]["coverage"] is None


@network
def test_several_targets_share_one_probe_matrix(real_cache, stub_probes, tmp_path, capsys):
    code = cli.main(["run", "sglang==0.5.19", "sglang==0.5.20", "--out", str(tmp_path), "--no-upstream-tests",
                     "--json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0 and document["exit_code"] == 0
    assert [r["spec"] for r in document["runs"]] == ["sglang==0.5.19", "sglang==0.5.20"]
    assert len(stub_probes) == 1, "one probe matrix for every tree of every run"
    roots = [root for _, root in stub_probes[0]]
    assert len(roots) == 6 and len(set(roots)) == 5, "the shared reference is one tree"
    for name in ("sglang-0.5.19", "sglang-0.5.20"):
        assert evidence.verify(tmp_path / name).ok


@network
def test_run_records_upstream_tests(real_cache, stub_probes, tmp_path, monkeypatch, capsys):
    import backport.upstream

    seen = {}

    def fake_tests(trees, refs, *, python, base_url=None, **_):
        seen.update(trees=[label for label, _ in trees], refs=refs, base_url=base_url)
        return {"skipped": None, "files": [], "trees": [
            {"tree": label, "tests": [{"file": refs[0].path, "rev": refs[0].rev, "sha256": D[8],
                                       "nodeid": refs[0].path + "::test_x",
                                       "outcome": "failed" if label == "pristine" else "passed",
                                       "reason": f"in {root}" if label == "pristine" else None}]}
            for label, root in trees]}

    monkeypatch.setattr(backport.upstream, "run_upstream_tests", fake_tests)
    out = tmp_path / "bundle"
    assert cli.main(["run", "sglang==0.5.19", "--out", str(out), "--upstream-base-url", "http://mirror.invalid",
                     "--reference", "none"]) == 0
    assert seen["trees"] == ["pristine", "patched"] and seen["base_url"] == "http://mirror.invalid"
    upstream = json.loads((out / "upstream-tests.json").read_text())
    assert upstream["trees"][0]["tests"][0]["reason"] == "in pristine"
    assert "| failed | passed |" in (out / "REPORT.md").read_text()
    assert json.loads((out / "receipt.json").read_text())["predicate"]["inputs"]["reference"] is None
    assert evidence.verify(out).ok
    assert "PASS" in capsys.readouterr().out


@network
def test_run_when_the_series_does_not_apply(real_cache, stub_probes, tmp_path, capsys):
    series = tmp_path / "patches"
    shutil.copytree(REPO / "patches", series)
    patch = series / "pr36988" / "pr36988-0.5.19.patch"
    text = patch.read_text()
    patch.write_text(text.replace("\n         logprob_pt = 0\n", "\n         logprob_pt = 12345\n", 1))
    out = tmp_path / "bundle"
    code = cli.main(
        ["run", "sglang==0.5.19", "--series", str(series), "--out", str(out), "--no-upstream-tests", "--json"]
    )
    captured = capsys.readouterr()
    assert code == 1 and "does not apply" in captured.err
    document = json.loads(captured.out)  # one document: the failed apply report
    assert document["result"] == "apply-failed" and document["apply"]["status"] == "failed"
    assert not out.exists() and stub_probes == []


@network
def test_a_release_the_pack_cannot_serve_gets_an_exposure_bundle(real_cache, stub_probes, tmp_path, capsys):
    """No variant of a fix for the release: one line says it stays exposed, the pristine tree alone is
    probed, and the bundle (mode `exposure`) shows that tree's cases and claims no patched tree."""
    series = tmp_path / "patches"
    shutil.copytree(REPO / "patches", series)
    (series / "pr36988" / "pr36988-0.5.19.patch").unlink()
    out = tmp_path / "bundle"
    code = cli.main(
        ["run", "sglang==0.5.19", "--series", str(series), "--out", str(out), "--no-upstream-tests"]
    )
    captured = capsys.readouterr()
    assert code == 1, captured.err
    line = captured.out.splitlines()[0]
    assert line.startswith("sglang 0.5.19 stays exposed: ") and "no variant of pr36988" in line, line
    assert "None" not in captured.out + captured.err
    assert [[role for role, _ in call] for call in stub_probes] == [["pristine"]]
    statement = json.loads((out / "receipt.json").read_text())
    _validate(statement)
    p = attached_from(out, statement)["predicate"]
    assert p["mode"] == "exposure" and p["apply"]["status"] == "failed" and p["inputs"]["patches"] == []
    assert set(p["inputs"]["trees"]) == {"pristine"} and p["inputs"]["reference"] is None
    assert [s["name"] for s in statement["subject"]] == ["pristine-tree/sglang"]
    unsafe = {f"{r['probe']}/{r['case']}" for r in p["cases"] if r["verdicts"]["pristine"] == "unsafe"}
    assert unsafe and all(
        r["pair"] == "still-unsafe" for r in p["cases"] if f"{r['probe']}/{r['case']}" in unsafe
    )
    vex = json.loads((out / "vex.openvex.json").read_text())
    assert "affected" in {s["status"] for s in vex["statements"]}
    assert "fixed" not in {s["status"] for s in vex["statements"]}
    assert "stays exposed" in (out / "REPORT.md").read_text()
    assert evidence.verify(out).ok
    edited = json.loads(json.dumps(statement))
    edited["predicate"]["mode"] = "backport"  # a receipt must not pass an exposure run off as a backport
    assert evidence.check_statement(edited)


@network
def test_run_head_mode_probes_two_given_trees(real_cache, release_tree, stub_probes, tmp_path, capsys):
    """`run BASE --head HEAD` (upstream's own before/after pairs): nothing applied, both trees probed."""
    base, head = release_tree("0.5.19"), release_tree("0.5.22")
    out = tmp_path / "pair"
    code = cli.main(
        [
            "run",
            str(base.path),
            "--head",
            str(head.path),
            "--reference",
            "none",
            "--out",
            str(out),
            "--no-upstream-tests",
            "--json",
        ]
    )
    assert code == 0, capsys.readouterr().err
    statement = json.loads((out / "receipt.json").read_text())
    _validate(statement)
    p = attached_from(out, statement)["predicate"]
    assert p["mode"] == "upstream-pair" and p["apply"] is None and p["inputs"]["patches"] == []
    assert p["inputs"]["trees"]["patched"]["version"] == "0.5.22"
    assert p["inputs"]["trees"]["pristine"]["tree_digest"] == base.tree_digest
    assert [[role for role, _ in call] for call in stub_probes] == [["pristine", "patched"]]
    assert not (out / "apply-report.json").exists()
    assert evidence.verify(out).ok


@network
def test_run_refuses_to_overwrite_a_directory_that_is_not_a_bundle(real_cache, stub_probes, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert cli.main(["run", "sglang==0.5.19", "--out", str(tmp_path), "--no-upstream-tests"]) == 2
    assert "not an evidence bundle" in capsys.readouterr().err
    assert stub_probes == [] and (tmp_path / "notes.txt").read_text() == "mine"


@network
def test_run_out_into_a_folder_with_someones_sha256sums_deletes_nothing(
    real_cache, stub_probes, tmp_path, capsys
):
    release = tmp_path / "release"
    release.mkdir()
    (release / "myapp-1.0.tar.gz").write_bytes(b"tarball")
    (release / "SHA256SUMS").write_text(f"{'0' * 64}  myapp-1.0.tar.gz\n")
    for extra in ([], ["--force"]):
        assert cli.main(["run", "sglang==0.5.19", "--out", str(release), "--no-upstream-tests", *extra]) == 2
        assert "not an evidence bundle" in capsys.readouterr().err
    assert sorted(p.name for p in release.iterdir()) == ["SHA256SUMS", "myapp-1.0.tar.gz"]
    assert (release / "myapp-1.0.tar.gz").read_bytes() == b"tarball" and stub_probes == []


@network
def test_a_second_run_into_a_signed_bundle_refuses_then_keeps_the_signature(real_cache, stub_probes, tmp_path,
                                                                             capsys):
    """Without --force: exit 2, one line, nothing changed. With --force: the old bundle, signature and a
    reviewer's notes with it, is moved aside whole (and still verifies with its key); the new one verifies."""
    import subprocess

    bundle, key, pub = tmp_path / "bundle", tmp_path / "k.pem", tmp_path / "k.pub"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)], check=True)
    subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True)
    run = ["run", "sglang==0.5.19", "--out", str(bundle), "--no-upstream-tests"]
    assert cli.main(run) == 0
    assert cli.main(["sign", str(bundle), "--key", str(key)]) == 0
    (bundle / "NOTES.txt").write_text("reviewed\n")
    before = {p.relative_to(bundle): p.read_bytes() for p in bundle.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert cli.main(run) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "pass --force" in err
    assert {p.relative_to(bundle): p.read_bytes() for p in bundle.rglob("*") if p.is_file()} == before
    assert cli.main([*run, "--force", "--json"]) == 0
    previous = Path(json.loads(capsys.readouterr().out)["previous_bundle"])
    assert {p.relative_to(previous): p.read_bytes() for p in previous.rglob("*") if p.is_file()} == before
    # verify names the reviewer's file as not the toolkit's; without it, the signature checks beside its
    # receipt
    assert evidence.verify(previous).first.file == "NOTES.txt"
    (previous / "NOTES.txt").unlink()
    assert cli.main(["verify", str(previous), "--key", str(pub)]) == 0
    assert cli.main(["verify", str(bundle)]) == 0 and not (bundle / "receipt.dsse.json").exists()


@network
def test_readme_first_command_twice_in_a_row(real_cache, stub_probes, tmp_path, monkeypatch, capsys):
    """The default directory evidence/<target>/ is the toolkit's own: a re-run replaces its own files
    without --force; what someone added there (a signature) moves aside with the old bundle."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["run", "sglang==0.5.19", "--no-upstream-tests"]) == 0
    capsys.readouterr()
    assert cli.main(["run", "sglang==0.5.19", "--no-upstream-tests", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["previous_bundle"] is None
    assert sorted(p.name for p in (tmp_path / "evidence").iterdir()) == ["sglang-0.5.19"]
    (tmp_path / "evidence" / "sglang-0.5.19" / "receipt.dsse.json").write_text("{}")
    assert cli.main(["run", "sglang==0.5.19", "--no-upstream-tests", "--json"]) == 0
    previous = Path(json.loads(capsys.readouterr().out)["previous_bundle"])
    assert (previous / "receipt.dsse.json").read_text() == "{}" and previous.parent == tmp_path / "evidence"


# ---- end to end ------------------------------------------------------------------------------------


@network
@pytest.mark.probe_env
def test_run_sglang_0_5_19_end_to_end(real_cache, probe_python, tmp_path, capsys):
    """README's first command, for real: exit 0, a bundle that verifies (also with sha256sum -c), the
    patched tree equal to the reference on every upstream fix's case, and the patches' lines covered."""
    out = tmp_path / "bundle"
    code = cli.main(
        [
            "run",
            "sglang==0.5.19",
            "--out",
            str(out),
            "--python",
            probe_python,
            "--no-upstream-tests",
            "--json",
        ]
    )
    document = json.loads(capsys.readouterr().out)
    assert document["bundle"] == str(out.absolute())
    statement = json.loads((out / "receipt.json").read_text())
    _validate(statement)
    assert evidence.verify(out).ok
    proc = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, check=False)
    assert proc.returncode == 0
    p = attached_from(out, statement)["predicate"]
    assert p["inputs"]["target"]["artifact_sha256"] == \
        "425e87377e725d03db8262382008f3fd9561a6cf5d82f485f8b9929f02ffe12b"
    assert p["apply"]["status"] == "applied"
    assert {"pristine", "patched", "reference"} <= set(p["probes"])
    assert code == 0, p["summary"]["findings"]
    coverage = p["coverage"]
    assert coverage["measured"] and coverage["totals"]["added"] > 0
    assert {e["fix"] for e in coverage["patches"]} == {x["fix"] for x in p["apply"]["patches"]
                                                       if x["status"] == "applied"}
    assert coverage["totals"]["percent"] == p["summary"]["coverage"]["percent"]
    assert "## Coverage of the patches" in (out / "REPORT.md").read_text()
