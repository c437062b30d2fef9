"""`export BUNDLE --image BASE`: the patched wheel as one layer over an operator's own SGLang image.

Operators run SGLang from images pinned by digest (`lmsysorg/sglang:vX-cuY@sha256:...`). The layer
holds exactly what installing the patched wheel over the pristine one changes: both wheels are
installed with `installer` into scratch prefixes laid out as the image's (`usr/local/lib/pythonX.Y/
site-packages` gives prefix `usr/local`, scripts in `usr/local/bin`); files the patched install
adds or changes go in, files only the pristine install has become OCI whiteouts (`.wh.<name>`; a
whole directory gone, such as the old dist-info, is one whiteout). The tar is deterministic:
sorted entries, fixed mtime/uid/gid/modes, gzip mtime 0; so the layer digest names the patch set.

Given the base as an OCI image layout (`--base-layout`), the result is a complete layout: the base's
layers plus this one, a config with its diff_id, a manifest and an index. Given only the reference,
the layer and a manifest fragment are written; a registry tool (or the Containerfile,
image_build.py) makes the image. Nothing here talks to a registry or a daemon.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from backport.digests import sha256_bytes
from backport.errors import BadInput

REFERENCE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9._/:-]*?)(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
                       r"@sha256:(?P<digest>[0-9a-f]{64})$")
MTIME = 946684800  # 2000-01-01, the date of the wheel's members (wheel.py)
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
INDEXES = (INDEX_TYPE, "application/vnd.docker.distribution.manifest.list.v2+json")


@dataclass(frozen=True)
class Reference:
    name: str           # registry/namespace/repository, as given
    tag: str | None
    digest: str         # sha256:<hex>

    @property
    def tagged(self) -> str:
        return f"{self.name}:{self.tag}" if self.tag else self.name

    def __str__(self) -> str:
        return f"{self.tagged}@{self.digest}"


def parse_reference(text: str) -> Reference:
    """`name[:tag]@sha256:<64 hex>`; a tag alone can move under the operator, so it is refused."""
    found = REFERENCE.match(text or "")
    if not found or "//" in found["name"] or found["name"].endswith(("/", ".", "-")):
        raise BadInput(f"--image {text!r}: not an image reference pinned by digest "
                       "(name[:tag]@sha256:<64 hex>)")
    return Reference(found["name"], found["tag"], "sha256:" + found["digest"])


def _sha(data: bytes) -> str:
    """An OCI digest: the algorithm named before the hex."""
    return "sha256:" + sha256_bytes(data)


def _canonical(document: dict) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


# ---- the install diff -------------------------------------------------------------------------

def install_wheel(wheel: Path, root: Path, site: str) -> None:
    """`installer` into `root`, laid out as the image: `site` is site-packages relative to `/`."""
    from installer import install
    from installer.destinations import SchemeDictionaryDestination
    from installer.sources import WheelFile

    parts = PurePosixPath(site).parts
    if "lib" not in parts or len(parts) < parts.index("lib") + 3:
        raise BadInput(f"--site-packages {site}: not <prefix>/lib/pythonX.Y/<site-packages or dist-packages>")
    prefix = PurePosixPath(*parts[:parts.index("lib")]) if parts.index("lib") else PurePosixPath(".")
    python = parts[parts.index("lib") + 1]
    scheme = {"purelib": site, "platlib": site, "scripts": f"{prefix}/bin", "data": str(prefix),
              "headers": f"{prefix}/include/{python}/sglang"}
    scheme = {key: str(root / value) for key, value in scheme.items()}
    interpreter = "/" + str(prefix / "bin" / "python3").lstrip("./")
    with WheelFile.open(wheel) as source:
        install(source, SchemeDictionaryDestination(scheme, interpreter, "posix"), {})


def _files(root: Path) -> dict[str, Path]:
    return {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


@dataclass(frozen=True)
class LayerChange:
    added: tuple[str, ...]      # new or changed files (paths from `/`, no leading slash)
    removed: tuple[str, ...]    # whiteout targets: files, or the topmost directory wholly gone


def diff_installs(pristine: Path, patched: Path) -> LayerChange:
    old, new = _files(pristine), _files(patched)
    added = tuple(sorted(n for n, p in new.items() if n not in old or old[n].read_bytes() != p.read_bytes()))
    new_dirs = {str(parent) for n in new for parent in PurePosixPath(n).parents}
    removed = set()
    for name in (n for n in old if n not in new):
        top = PurePosixPath(name)
        while str(top.parent) != "." and str(top.parent) not in new_dirs:
            top = top.parent  # whiteout the highest directory the patched install does not have
        removed.add(str(top))
    return LayerChange(added, tuple(sorted(removed)))


def layer_tar(root: Path, change: LayerChange) -> bytes:
    """The uncompressed layer: directories, added files, then `.wh.` markers, each sorted."""
    whiteouts = {str(PurePosixPath(n).parent / f".wh.{PurePosixPath(n).name}"): n for n in change.removed}
    members = sorted([*change.added, *whiteouts])
    dirs = sorted({str(p) for m in members for p in PurePosixPath(m).parents if str(p) != "."})
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted([*dirs, *members]):
            info = tarfile.TarInfo(name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = MTIME, 0, 0, "", ""
            if name in dirs:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif name in whiteouts:
                info.mode, info.size = 0o644, 0
                tar.addfile(info, io.BytesIO(b""))
            else:
                path = root / name
                data = path.read_bytes()
                info.mode = 0o755 if path.stat().st_mode & 0o111 else 0o644
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def gzipped(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", fileobj=buffer, mode="wb", compresslevel=6, mtime=0) as out:
        out.write(data)
    return buffer.getvalue()


# ---- the base image as an OCI layout ------------------------------------------------------------

class Layout:
    """An OCI image layout directory: blobs by digest, `index.json` at the top."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not (self.root / "oci-layout").is_file() or not (self.root / "index.json").is_file():
            raise BadInput(f"--base-layout {root}: not an OCI image layout (no oci-layout/index.json)")

    def blob(self, digest: str) -> bytes:
        path = self.root / "blobs" / digest.replace(":", "/", 1)
        if not path.is_file():
            raise BadInput(f"--base-layout {self.root}: blob {digest} is missing")
        data = path.read_bytes()
        if _sha(data) != digest:
            raise BadInput(f"--base-layout {self.root}: blob {digest} does not match its digest")
        return data

    def manifest_of(self, reference: Reference) -> tuple[dict, dict]:
        """(the manifest's descriptor, the manifest) the reference's digest names: a manifest listed in
        index.json, or a linux/amd64 entry of an image index so listed (the wheel is x86_64)."""
        for entry in json.loads((self.root / "index.json").read_text()).get("manifests", []):
            if entry.get("digest") != reference.digest:
                continue
            document = json.loads(self.blob(entry["digest"]))
            if entry.get("mediaType") in INDEXES or document.get("mediaType") in INDEXES:
                entry = next((m for m in document.get("manifests", [])
                              if (m.get("platform") or {}).get("architecture") == "amd64"), None)
                if entry is None:
                    raise BadInput(f"--base-layout {self.root}: {reference} has no linux/amd64 image")
                document = json.loads(self.blob(entry["digest"]))
            return entry, document
        raise BadInput(f"--base-layout {self.root}: index.json lists no {reference.digest}; "
                       "it is not the image --image names")

    def layer_names(self, descriptor: dict) -> list[str]:
        data = self.blob(descriptor["digest"])
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            return [(m.name[2:] if m.name.startswith("./") else m.name).lstrip("/") for m in tar]


def find_site_packages(layout: Layout, manifest: dict, release: str) -> str:
    """Where the base image installed `sglang-<release>`: the folder holding its dist-info (the last
    layer that has one); a base with another sglang, or none, is not a base for this wheel."""
    found, others = None, set()
    for descriptor in manifest["layers"]:
        for name in layout.layer_names(descriptor):
            hit = re.match(r"^(.+)/sglang-([^/]+)\.dist-info/METADATA$", name)
            if hit and hit[2] == release:
                found = hit[1]
            elif hit:
                others.add(hit[2])
    if found is None:
        seen = f" (it has sglang {', '.join(sorted(others))})" if others else ""
        raise BadInput(f"the base image has no sglang {release} installed{seen}: the wheel is for {release}")
    return found


# ---- writing ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageLayer:
    tar_gz: bytes
    diff_id: str
    site_packages: str
    change: LayerChange

    @property
    def descriptor(self) -> dict:
        return {"mediaType": LAYER_TYPE, "digest": _sha(self.tar_gz), "size": len(self.tar_gz)}


def build_layer(pristine_wheel: Path, patched_wheel: Path, site: str) -> ImageLayer:
    scratch = Path(tempfile.mkdtemp(prefix="sglang-backport-image-"))
    try:
        install_wheel(pristine_wheel, scratch / "pristine", site)
        install_wheel(patched_wheel, scratch / "patched", site)
        change = diff_installs(scratch / "pristine", scratch / "patched")
        tar = layer_tar(scratch / "patched", change)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return ImageLayer(gzipped(tar), _sha(tar), site, change)


def write_blob(out: Path, data: bytes) -> str:
    digest = _sha(data)
    path = out / "blobs" / digest.replace(":", "/", 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def write_layout(out: Path, base: Layout, reference: Reference, layer: ImageLayer, version: str) -> dict:
    """The base's blobs, the layer, a config with its diff_id appended, a manifest and an index.
    Returns the new manifest's descriptor."""
    _, manifest = base.manifest_of(reference)
    config = json.loads(base.blob(manifest["config"]["digest"]))
    config.setdefault("rootfs", {"type": "layers", "diff_ids": []})["diff_ids"].append(layer.diff_id)
    config.setdefault("history", []).append(
        {"created_by": f"sglang-backport export --image: pip install --no-deps sglang=={version}",
         "comment": "the patched wheel's install over the pristine one"})
    for descriptor in manifest["layers"]:
        write_blob(out, base.blob(descriptor["digest"]))
    write_blob(out, layer.tar_gz)
    config_bytes = _canonical(config)
    config_digest = write_blob(out, config_bytes)
    new_manifest = {
        "schemaVersion": 2, "mediaType": MANIFEST_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config_bytes)},
        "layers": [*manifest["layers"], layer.descriptor],
        "annotations": {"org.opencontainers.image.base.name": reference.tagged,
                        "org.opencontainers.image.base.digest": reference.digest},
    }
    manifest_bytes = _canonical(new_manifest)
    descriptor = {"mediaType": MANIFEST_TYPE, "digest": write_blob(out, manifest_bytes),
                  "size": len(manifest_bytes), "platform": {"architecture": "amd64", "os": "linux"},
                  "annotations": {"org.opencontainers.image.ref.name": version.replace("+", "-")}}
    (out / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}) + "\n")
    (out / "index.json").write_bytes(_canonical({"schemaVersion": 2, "mediaType": INDEX_TYPE,
                                                  "manifests": [descriptor]}))
    return descriptor


def write_fragment(out: Path, reference: Reference, layer: ImageLayer) -> Path:
    """No base layout: the layer blob and what a tool needs to append it to BASE."""
    write_blob(out, layer.tar_gz)
    path = out / "layer.json"
    path.write_text(json.dumps({"base": str(reference), "layer": layer.descriptor, "diff_id": layer.diff_id,
                                "site_packages": layer.site_packages,
                                "note": "a layer and a manifest fragment, not an image: append the layer to "
                                        "BASE's manifest and its diff_id to BASE's config"},
                               indent=2, sort_keys=True) + "\n")
    return path
