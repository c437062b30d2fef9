"""`export BUNDLE --image BASE --image-out DIR`: what an operator builds and scans.

DIR receives:
- `Containerfile` and `backport-check.py`, the build any OCI tool runs (buildah, podman, docker
  build, kaniko): FROM BASE, check the base's sglang is the release the wheel patches, `pip install
  --no-deps --force-reinstall` the wheel, check again. The check is a self-contained script (the
  toolkit is not in the base image): the installed distribution's version must be the wheel's, and
  every file the wheel's RECORD lists must be installed with the RECORD's sha256; a wrong base (another
  release, another Python whose pip refuses the wheel's tags) fails the build.
- the wheel itself (COPY'd by the Containerfile);
- `oci/`: the layer built offline (image.py), a complete image layout with `--base-layout`, else
  the layer blob and `layer.json`;
- `image.openvex.json` when the image was built: the bundle's wheel statements, their product the image
  by its manifest digest (`pkg:oci/...`) with the wheel's purl as a subcomponent.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from backport import cache
from backport.digests import sha256_file
from backport.errors import BadInput
from backport.evidence.artifacts import PROVENANCE
from backport.export.image import (
    Layout,
    Reference,
    build_layer,
    find_site_packages,
    write_fragment,
    write_layout,
)

CHECK = "backport-check.py"
CONTAINERFILE = "Containerfile"
IMAGE_VEX = "image.openvex.json"

CHECK_SCRIPT = '''"""Run inside the image build (written by sglang-backport export --image): fails the
build unless sglang is the release the wheel patches (`base X`) or the patched wheel, file for
file (`patched V WHEEL`)."""
import base64
import csv
import hashlib
import importlib.metadata as metadata
import io
import sys
import zipfile
from pathlib import Path


def fail(message):
    print(f"backport-check: {message}", file=sys.stderr)
    sys.exit(1)


def installed_version():
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


mode, expected = sys.argv[1], sys.argv[2]
found = installed_version()
if found != expected:
    fail(f"sglang is {found or 'not installed'}, expected {expected}"
         + (": the base image is not the release this wheel patches" if mode == "base" else ""))
if mode == "patched":
    site = Path(metadata.distribution("sglang").locate_file(""))
    with zipfile.ZipFile(sys.argv[3]) as wheel:
        (record,) = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
        rows = list(csv.reader(io.StringIO(wheel.read(record).decode("utf-8"))))
    checked = 0
    for path, digest, _ in rows:
        if not digest or path.split("/", 1)[0].endswith(".data"):
            continue  # RECORD itself; .data files move out of site-packages
        algorithm, _, value = digest.partition("=")
        try:
            data = (site / path).read_bytes()
        except OSError:
            fail(f"{path}: listed in the wheel's RECORD, not installed")
        actual = base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=").decode()
        if actual != value:
            fail(f"{path}: installed bytes differ from the wheel's RECORD")
        checked += 1
    print(f"backport-check: sglang {expected}, {checked} files equal the wheel's RECORD")
else:
    print(f"backport-check: base has sglang {expected}")
'''


def containerfile(reference: Reference, wheel: str, release: str, version: str) -> str:
    stage = "/tmp/sglang-backport"
    return (
        f"# Written by sglang-backport export --image: sglang {version} over {reference}.\n"
        "# Build with any OCI tool from this directory, e.g. `buildah build -t IMAGE .`;\n"
        "# PYTHON is the base image's interpreter (the one its sglang is installed for).\n"
        f"FROM {reference}\n"
        "ARG PYTHON=python3\n"
        f"COPY {CHECK} {wheel} {stage}/\n"
        f"RUN ${{PYTHON}} {stage}/{CHECK} base {release} \\\n"
        f" && ${{PYTHON}} -m pip install --no-deps --force-reinstall --no-cache-dir {stage}/{wheel} \\\n"
        f" && ${{PYTHON}} {stage}/{CHECK} patched {version} {stage}/{wheel} \\\n"
        f" && rm -rf {stage}\n"
        f'LABEL org.opencontainers.image.base.name="{reference.tagged}" \\\n'
        f'      org.opencontainers.image.base.digest="{reference.digest}" \\\n'
        f'      dev.sglang-backport.version="{version}"\n'
    )


def image_purl(reference: Reference, manifest_digest: str) -> str:
    """purl-spec's oci type: the last path segment as name, the digest as version, the repository
    (registry and path) as repository_url."""
    name = reference.name.rsplit("/", 1)[-1]
    repository = quote(reference.name, safe="/")
    return f"pkg:oci/{name}@{quote(manifest_digest, safe='')}?repository_url={repository}"


def image_vex(bundle_vex: dict, wheel_purl: str, purl: str) -> dict:
    """The bundle's statements about the wheel, each now about the image that carries it."""
    statements = []
    for statement in bundle_vex["statements"]:
        wheel = next((p for p in statement["products"] if p.get("@id") == wheel_purl), None)
        if wheel is None:
            continue
        item = {key: value for key, value in statement.items() if key != "products"}
        item["products"] = [{"@id": purl, "identifiers": {"purl": purl}, "subcomponents": [wheel]}]
        statements.append(item)
    if not statements:
        raise BadInput(f"the bundle's OpenVEX has no statement about {wheel_purl}")
    digest = purl.split("@", 1)[1].split("?", 1)[0]
    return {**{k: v for k, v in bundle_vex.items() if k != "statements"},
            "@id": f"{bundle_vex['@id']}/image/{digest}", "statements": statements}


def pristine_wheel(provenance: dict) -> Path:
    """The upstream wheel the patched one was made from, by the sha256 its record names."""
    from backport.releases import load_pins
    from backport.sources.wheel import WheelSource

    upstream = provenance["upstream_wheel"]
    kept = cache.cache_root() / "wheels" / upstream["name"]
    if kept.is_file() and sha256_file(kept) == upstream["sha256"]:
        return kept
    release = provenance["version"].split("+", 1)[0]
    pin = load_pins().get(release)
    if pin is not None and pin.sha256 == upstream["sha256"]:
        return WheelSource(provenance["spec"], release, pin)._download(cache.cache_root())
    raise BadInput(f"the upstream wheel {upstream['name']} (sha256 {upstream['sha256'][:12]}...) is neither "
                   f"pinned nor in {cache.cache_root() / 'wheels'}")


def read_provenance(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(f".dist-info/{PROVENANCE}")]
        if len(names) != 1:
            raise BadInput(f"{wheel.name}: not a wheel exported by sglang-backport (no {PROVENANCE})")
        return json.loads(archive.read(names[0]))


@dataclass(frozen=True)
class ImageExport:
    out: Path
    containerfile: Path
    layer: dict                   # the layer's descriptor, with its diff_id
    manifest: dict | None         # the new image's manifest descriptor (None: no base layout given)
    vex: Path | None
    purl: str | None

    def to_json(self) -> dict:
        return {"out": str(self.out), "containerfile": str(self.containerfile), "layer": self.layer,
                "manifest": self.manifest, "vex": str(self.vex) if self.vex else None, "purl": self.purl,
                "complete_layout": self.manifest is not None}


def export_image(wheel: Path, reference: Reference, out: Path, base_layout: Path | None,
                 site_packages: str | None, bundle_vex: dict | None, wheel_purl: str) -> ImageExport:
    provenance = read_provenance(wheel)
    version = provenance["version"]
    release = version.split("+", 1)[0]
    layout = Layout(base_layout) if base_layout else None
    manifest = layout.manifest_of(reference)[1] if layout else None
    if layout and manifest is not None:
        found = find_site_packages(layout, manifest, release)
        if site_packages and site_packages.strip("/") != found:
            raise BadInput(f"--site-packages {site_packages}: the base has sglang {release} in /{found}")
        site_packages = found
    if not site_packages:
        raise BadInput("--image without --base-layout needs --site-packages (the base image's site-packages, "
                       "e.g. /usr/local/lib/python3.11/site-packages)")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wheel, out / wheel.name)
    (out / CHECK).write_text(CHECK_SCRIPT)
    (out / CONTAINERFILE).write_text(containerfile(reference, wheel.name, release, version))
    layer = build_layer(pristine_wheel(provenance), wheel, site_packages.strip("/"))
    described = {**layer.descriptor, "diff_id": layer.diff_id, "site_packages": "/" + layer.site_packages,
                 "added": len(layer.change.added), "whiteouts": len(layer.change.removed)}
    if layout is None:
        write_fragment(out / "oci", reference, layer)
        return ImageExport(out, out / CONTAINERFILE, described, None, None, None)
    descriptor = write_layout(out / "oci", layout, reference, layer, version)
    purl = image_purl(reference, descriptor["digest"])
    vex_path = None
    if bundle_vex is not None:
        vex_path = out / IMAGE_VEX
        statement = image_vex(bundle_vex, wheel_purl, purl)
        from backport.evidence.vex import schema_errors

        problem = schema_errors(statement)
        if problem:  # a statement scanners would reject is not written
            raise BadInput(f"the image OpenVEX does not match the schema: {problem}")
        vex_path.write_text(json.dumps(statement, indent=2, sort_keys=True) + "\n")
    return ImageExport(out, out / CONTAINERFILE, described, descriptor, vex_path, purl)
