"""`export BUNDLE --image BASE`: a patched layer over a base image the test makes itself.

The base is an OCI image layout of one layer: a stand-in Python prefix (`usr/local/bin/python3` is a
marker file, not an interpreter: nothing runs inside the image here) whose site-packages has the
real pristine sglang 0.5.19 wheel installed with `installer`. The bundle is a real `run sglang==0.5.19
--export` (stub probe verdicts, real wheel; test_run_export.py's fixture). Unpacking the base and the
new layer in order, whiteouts honoured, must give a site-packages equal, path for path and byte for
byte, to a plain `installer` install of the patched wheel.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from backport import cli
from backport.errors import BadInput
from backport.evidence import vex
from backport.export.image import install_wheel, parse_reference
from backport.export.image_build import CHECK, export_image, pristine_wheel, read_provenance
from tests.conftest import WORKSPACE_CACHE
from tests.test_job import real_cache  # noqa: F401 - a fixture
from tests.test_run_export import exported_run  # noqa: F401 - a fixture

SITE = "usr/local/lib/python3.11/site-packages"
PYTHON = sys.executable


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob(layout: Path, digest: str) -> bytes:
    data = (layout / "blobs" / digest.replace(":", "/", 1)).read_bytes()
    assert _sha(data) == digest  # every blob is what its digest says
    return data


def _tar_of(root: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(root.rglob("*")):
            tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False)
    return buffer.getvalue()


def make_base(root: Path, layout: Path, tag: str = "v0.5.19") -> str:
    """An OCI layout of one image whose only layer is `root`; returns its pinned reference."""
    tar = _tar_of(root)
    layer = gzip.compress(tar, mtime=0)
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/local/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": [_sha(tar)]}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": _sha(config), "size": len(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                       "digest": _sha(layer), "size": len(layer)}]}).encode()
    for data in (layer, config, manifest):
        path = layout / "blobs" / "sha256" / hashlib.sha256(data).hexdigest()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": _sha(manifest),
         "size": len(manifest)}]}))
    return f"registry.example/lmsysorg/sglang:{tag}@{_sha(manifest)}"


def unpack(layout: Path, manifest: dict, into: Path) -> None:
    """Apply the layers in order as a container runtime does: `.wh.<name>` removes name, the rest lands."""
    for descriptor in manifest["layers"]:
        with tarfile.open(fileobj=io.BytesIO(_blob(layout, descriptor["digest"])), mode="r:gz") as tar:
            for member in tar:
                target = into / member.name
                if member.name.rsplit("/", 1)[-1].startswith(".wh."):
                    gone = target.parent / target.name[len(".wh."):]
                    shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
                elif member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())
                    target.chmod(member.mode)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- offline: references ----------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "lmsysorg/sglang:v0.5.19-cu129",                    # a tag can move: refused
    "lmsysorg/sglang@sha256:" + "a" * 63,               # short digest
    "lmsysorg/sglang@sha256:" + "A" * 64,               # not lower-case hex
    "lmsysorg/sglang@sha512:" + "a" * 64,
    "LMSYS/sglang@sha256:" + "a" * 64,                  # repository names are lower case
    "",
])
def test_a_reference_not_pinned_by_digest_is_exit_2(text, tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "--image", text, "--image-out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pinned by digest" in err[0]
    assert not (tmp_path / "o").exists()


def test_image_options_that_do_not_fit_are_exit_2(tmp_path, capsys):
    ref = "lmsysorg/sglang@sha256:" + "a" * 64
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    out, wheels = str(tmp_path / "o"), str(tmp_path / "w")
    for args, says in ([["--image", ref], "needs --image-out"],
                       [["--wheel", wheels, "--image-out", out], "go with --image"],
                       [["--image", ref, "--image-out", str(tmp_path / "full")], "not an empty directory"],
                       [["--image", ref, "--image-out", out, "--base-layout", str(tmp_path / "no")],
                        "not a directory"]):
        assert cli.main(["export", str(tmp_path), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "o").exists() and not (tmp_path / "w").exists()


def test_a_pinned_reference_parses():
    ref = parse_reference("docker.io/lmsysorg/sglang:v0.5.19-cu129@sha256:" + "0" * 64)
    assert (ref.name, ref.tag) == ("docker.io/lmsysorg/sglang", "v0.5.19-cu129")
    assert ref.digest == "sha256:" + "0" * 64
    assert parse_reference("localhost:5000/sglang@sha256:" + "1" * 64).tag is None


# ---- the image over a self-made base --------------------------------------------------------------

@pytest.fixture(scope="module")
def images(exported_run, tmp_path_factory):  # noqa: F811 - the imported fixture
    """The base (pristine 0.5.19 installed), and `export BUNDLE --image` over it."""
    mp = pytest.MonkeyPatch()
    mp.setenv("SGLANG_BACKPORT_CACHE", str(WORKSPACE_CACHE))
    try:
        work = tmp_path_factory.mktemp("image")
        wheel = next((exported_run / "export").glob("sglang-*.whl"))
        pristine = pristine_wheel(read_provenance(wheel))
        install_wheel(pristine, work / "rootfs", SITE)
        (work / "rootfs/usr/local/bin/python3").write_text("stand-in for the base image's interpreter\n")
        reference = make_base(work / "rootfs", work / "base")
        assert cli.main(["export", str(exported_run), "--image", reference, "--image-out", str(work / "out"),
                         "--base-layout", str(work / "base"), "--json"]) == 0
        return work, wheel, pristine, reference
    finally:
        mp.undo()


@pytest.mark.network  # the real 0.5.19 wheel (cached after the first run)
def test_the_layered_site_packages_equal_a_plain_install_of_the_patched_wheel(images, tmp_path):
    work, wheel, _, _ = images
    layout = work / "out" / "oci"
    (entry,) = json.loads((layout / "index.json").read_text())["manifests"]
    manifest = json.loads(_blob(layout, entry["digest"]))
    unpack(layout, manifest, tmp_path / "image")
    install_wheel(wheel, tmp_path / "plain", SITE)
    image, plain = _tree(tmp_path / "image" / SITE), _tree(tmp_path / "plain" / SITE)
    assert sorted(image) == sorted(plain) and image == plain
    assert not any(name.startswith("sglang-0.5.19.dist-info/") for name in image)  # whited out
    # the layer holds only what changed: far fewer files than the ~4,900 of the package
    new_layer = manifest["layers"][-1]
    with tarfile.open(fileobj=io.BytesIO(_blob(layout, new_layer["digest"])), mode="r:gz") as tar:
        names = tar.getnames()
        tar_bytes = gzip.decompress(_blob(layout, new_layer["digest"]))
    assert f"{SITE}/.wh.sglang-0.5.19.dist-info" in names and len(names) < 200
    assert names == sorted(names)  # deterministic order
    config = json.loads(_blob(layout, manifest["config"]["digest"]))
    assert config["rootfs"]["diff_ids"][-1] == _sha(tar_bytes) and len(config["rootfs"]["diff_ids"]) == 2
    base_digest = parse_reference(images[3]).digest
    assert manifest["layers"][:-1] == json.loads(_blob(work / "base", base_digest))["layers"]
    assert manifest["annotations"]["org.opencontainers.image.base.digest"] == base_digest


@pytest.mark.network
def test_the_image_vex_names_the_image_by_digest_with_the_wheel_inside(images, exported_run):  # noqa: F811
    work = images[0]
    (entry,) = json.loads((work / "out" / "oci" / "index.json").read_text())["manifests"]
    document = json.loads((work / "out" / "image.openvex.json").read_text())
    assert vex.schema_errors(document) is None
    bundle = json.loads((exported_run / vex.VEX).read_text())
    wheel_purl = next(p["@id"] for s in bundle["statements"] for p in s["products"]
                      if p["@id"].startswith("pkg:"))
    expected = [(s["vulnerability"]["name"], s["status"]) for s in bundle["statements"]
                if any(p["@id"] == wheel_purl for p in s["products"])]
    assert expected
    assert [(s["vulnerability"]["name"], s["status"]) for s in document["statements"]] == expected
    hex_digest = entry["digest"].split(":")[1]
    for statement in document["statements"]:
        (product,) = statement["products"]
        assert product["@id"].startswith(f"pkg:oci/sglang@sha256%3A{hex_digest}?repository_url=")
        assert [c["@id"] for c in product["subcomponents"]] == [wheel_purl]


@pytest.mark.network
def test_the_check_script_passes_the_patched_install_and_fails_a_wrong_one(images, tmp_path):
    work, wheel, _, _ = images
    layout = work / "out" / "oci"
    (entry,) = json.loads((layout / "index.json").read_text())["manifests"]
    unpack(layout, json.loads(_blob(layout, entry["digest"])), tmp_path / "image")
    version = read_provenance(wheel)["version"]

    def check(site: Path, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(site)}
        return subprocess.run([PYTHON, "-S", str(work / "out" / CHECK), *args], env=env,
                              capture_output=True, text=True, check=False)

    site = tmp_path / "image" / SITE
    assert check(work / "rootfs" / SITE, "base", "0.5.19").returncode == 0
    done = check(site, "patched", version, str(wheel))
    assert done.returncode == 0 and "files equal the wheel's RECORD" in done.stdout
    assert check(site, "base", "0.5.19").returncode == 1  # a base that is not the release
    edited = site / "sglang" / "_version.py"
    edited.write_bytes(edited.read_bytes() + b"\n# edited\n")
    wrong = check(site, "patched", version, str(wheel))
    assert wrong.returncode == 1 and "sglang/_version.py" in wrong.stderr
    text = (work / "out" / "Containerfile").read_text()
    assert f"FROM {images[3]}\n" in text and "pip install --no-deps --force-reinstall" in text
    assert (work / "out" / wheel.name).read_bytes() == wheel.read_bytes()


@pytest.mark.network
def test_the_layer_is_deterministic_and_a_wrong_base_is_refused(images, tmp_path, real_cache):  # noqa: F811
    work, wheel, _, reference = images
    again = export_image(wheel, parse_reference(reference), tmp_path / "again", work / "base", None, None,
                         "pkg:pypi/sglang")
    (entry,) = json.loads((work / "out" / "oci" / "index.json").read_text())["manifests"]
    assert again.manifest is not None and again.manifest["digest"] == entry["digest"]
    # only a reference: the layer and a fragment, the same layer bytes
    alone = export_image(wheel, parse_reference(reference), tmp_path / "alone", None, "/" + SITE, None, "x")
    fragment = json.loads((tmp_path / "alone" / "oci" / "layer.json").read_text())
    assert alone.manifest is None and alone.vex is None
    assert fragment["layer"]["digest"] == again.layer["digest"]
    # a base with another release of sglang
    other = tmp_path / "other-root" / SITE / "sglang-0.5.18.dist-info"
    other.mkdir(parents=True)
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.18\n")
    wrong = make_base(tmp_path / "other-root", tmp_path / "other", "v0.5.18")
    with pytest.raises(BadInput, match=r"no sglang 0\.5\.19 installed \(it has sglang 0\.5\.18\)"):
        export_image(wheel, parse_reference(wrong), tmp_path / "w", tmp_path / "other", None, None, "x")
    # the layout is not the image the reference names
    with pytest.raises(BadInput, match="lists no sha256:"):
        export_image(wheel, parse_reference(wrong), tmp_path / "w2", work / "base", None, None, "x")


@pytest.mark.network
def test_a_patched_tree_gives_the_same_layer_as_its_bundle(images, patched_tree, tmp_path, real_cache):  # noqa: F811
    """`export TREE --image`: the wheel built from the tree, the same patch set, the same layer bytes."""
    work, *_ = images
    tree, _ = patched_tree("0.5.19")
    bundle_layer = json.loads((work / "out" / "oci" / "index.json").read_text())["manifests"][0]
    bundle_manifest = json.loads(_blob(work / "out" / "oci", bundle_layer["digest"]))
    assert cli.main(["export", str(tree.path), "--image", images[3], "--image-out", str(tmp_path / "o"),
                     "--site-packages", "/" + SITE]) == 0
    fragment = json.loads((tmp_path / "o" / "oci" / "layer.json").read_text())
    assert fragment["layer"] == bundle_manifest["layers"][-1]
    assert not (tmp_path / "o" / "image.openvex.json").exists()  # a tree has no statements
