"""Shipping commands: `export TREE_OR_BUNDLE --wheel DIR --patches DIR` (a patched tree of a wheel
target as a deployable wheel and a patch series, or those files out of a verified `run --export`
bundle) and `sign BUNDLE --key KEY` (a DSSE envelope over the receipt)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backport.cli import emit
from backport.errors import BadInput, Finding


def cmd_export(args) -> int:
    from backport.export import build_wheel, read_lineage, write_series

    if not args.wheel and not args.patches and args.image is None:
        raise BadInput("export: nothing to write (give --wheel DIR, --patches DIR, --image BASE)")
    reference = _image_options(args)
    target = Path(args.tree)
    if args.patches and Path(args.patches).exists() and (
            not Path(args.patches).is_dir() or any(Path(args.patches).iterdir())):
        raise BadInput(f"--patches {args.patches}: exists and is not an empty directory")
    if (target / "receipt.json").is_file() and (target / "SHA256SUMS").is_file():
        return _from_bundle(args, target, reference)
    lineage = read_lineage(target)
    document: dict[str, Any] = {"tree": str(lineage.root), "spec": lineage.spec, "label": lineage.label,
                "patch_set_sha256": lineage.patch_set_sha256, "tree_digest": lineage.tree_digest,
                "commits": list(lineage.commits), "wheel": None, "patches": None}
    lines = [(f"{lineage.spec}: {len(lineage.commits)} backport commits, "
              f"patch set {lineage.patch_set_sha256[:12]}, tree {lineage.tree_digest[:12]}")]
    if args.patches:
        written = write_series(lineage, Path(args.patches))
        document["patches"] = [str(p) for p in written]
        lines.append(f"patches: {len(written)} files in {Path(args.patches).resolve()}")
    if args.wheel:
        exported = build_wheel(lineage, Path(args.wheel))
        document["wheel"] = {**exported.to_json(), "path": str(exported.path)}
        lines.append(f"wheel: {exported.path}\n  version {exported.version}  sha256 {exported.sha256}")
    if reference is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            built = build_wheel(lineage, Path(scratch))
            _image(args, reference, built.path, None, document, lines)
    emit(args, document, "\n".join(lines))
    return 0


def _image_options(args):
    """BASE parsed first: a bad reference is exit 2 before any slow step."""
    if args.image is None:
        if args.image_out or args.base_layout or args.site_packages:
            raise BadInput("--image-out, --base-layout and --site-packages go with --image BASE")
        return None
    from backport.export.image import parse_reference

    reference = parse_reference(args.image)
    if not args.image_out:
        raise BadInput("--image needs --image-out DIR (the Containerfile, the OCI layer, the image VEX)")
    out = Path(args.image_out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"--image-out {out}: exists and is not an empty directory")
    if args.base_layout and not Path(args.base_layout).is_dir():
        raise BadInput(f"--base-layout {args.base_layout}: not a directory")
    return reference


def _image(args, reference, wheel: Path, bundle_vex: dict | None, document: dict, lines: list[str]) -> None:
    from backport.evidence.identifiers import wheel_purl
    from backport.export.image_build import export_image, read_provenance
    from backport.job.progress import heartbeat

    purl = wheel_purl(read_provenance(wheel)["version"])
    with heartbeat(f"building the image layer over {reference}"):  # two installs of the wheel, diffed
        made = export_image(wheel, reference, Path(args.image_out),
                            Path(args.base_layout) if args.base_layout else None,
                            args.site_packages, bundle_vex, purl)
    document["image"] = made.to_json()
    lines.append(f"image: {made.containerfile} (FROM {reference})")
    lines.append(f"  layer {made.layer['digest']}: {made.layer['added']} files, "
                 f"{made.layer['whiteouts']} whiteouts, over {made.layer['site_packages']}")
    if made.manifest is None:
        fragment = made.out / "oci" / "layer.json"
        lines.append(f"  no --base-layout: the layer and {fragment} only, not an image")
    else:
        lines.append(f"  OCI layout {made.out / 'oci'}: manifest {made.manifest['digest']}")
        lines.append(f"  image VEX {made.vex} ({made.purl})" if made.vex else
                     "  no image VEX: a patched tree has no statements (export a bundle of `run --export`)")


def _from_bundle(args, bundle: Path, reference=None) -> int:
    """A bundle of `run --export`: copy out its wheel and series, once the bundle verifies (a bundle
    holds no tree to build them from)."""
    import json
    import shutil

    from backport import evidence

    def no_exports() -> BadInput:
        return BadInput(f"{bundle}: an evidence bundle without exports (made without `run --export`); "
                        "export the patched tree instead (`run --keep-trees` or `apply --out`)")

    try:  # a receipt that names no export is refused before the long verification
        unverified = json.loads((bundle / evidence.RECEIPT).read_bytes())["predicate"].get("export")
    except (ValueError, KeyError, TypeError, AttributeError):
        unverified = True  # unreadable: verify below names what is wrong
    if not unverified:
        raise no_exports()
    from backport.job.progress import heartbeat

    with heartbeat(f"verifying {bundle}"):  # every digest of the bundle, the wheel's tree among them
        result = evidence.verify(bundle)
    if not result.ok:
        raise Finding(f"{bundle}: does not verify ({result.first}); nothing exported")
    export = json.loads((bundle / evidence.RECEIPT).read_text())["predicate"].get("export")
    if not export:
        raise no_exports()
    document = {
        "bundle": str(bundle),
        "label": export["label"],
        "patch_set_sha256": export["patch_set_sha256"],
        "wheel": None,
        "patches": None,
    }
    lines = [f"{bundle}: verified; patch set {export['patch_set_sha256'][:12]}"]
    if args.wheel:
        Path(args.wheel).mkdir(parents=True, exist_ok=True)
        wheel = export["wheel"]
        copied = Path(shutil.copyfile(bundle / wheel["file"], Path(args.wheel) / wheel["name"]))
        document["wheel"] = {**wheel, "path": str(copied)}
        lines.append(f"wheel: {copied}\n  version {wheel['version']}  sha256 {wheel['sha256']}")
    if args.patches:
        Path(args.patches).mkdir(parents=True, exist_ok=True)
        series = [Path(shutil.copyfile(bundle / p["file"], Path(args.patches) / Path(p["file"]).name))
                  for p in export["patches"]]
        document["patches"] = [str(p) for p in series]
        lines.append(f"patches: {len(series)} files in {Path(args.patches).resolve()}")
    if reference is not None:
        from backport.evidence.vex import VEX

        vex = json.loads((bundle / VEX).read_text()) if (bundle / VEX).is_file() else None
        _image(args, reference, bundle / export["wheel"]["file"], vex, document, lines)
    emit(args, document, "\n".join(lines))
    return 0


def cmd_sign(args) -> int:
    from backport.evidence import sign

    bundle = Path(args.bundle)
    if not (bundle / "receipt.json").is_file():
        raise BadInput(f"{bundle}: not an evidence bundle (no receipt.json)")
    signed = sign.sign_bundle(bundle, Path(args.key))
    emit(args, {"bundle": str(bundle), "envelope": str(signed.envelope), "keyid": signed.keyid},
         f"signed {bundle}: {signed.envelope.name} (key {signed.keyid[:16]})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("export", help="a patched tree as a deployable wheel and/or a git format-patch series")
    p.add_argument("tree", metavar="TREE_OR_BUNDLE",
                   help="a patched tree of a wheel target (apply --out, run --keep-trees), or a bundle of "
                        "`run --export` (its files are copied out once it verifies)")
    p.add_argument("--wheel", metavar="DIR", help="write sglang-X+backport.N-<tags>.whl here")
    p.add_argument(
        "--patches",
        metavar="DIR",
        help="write the backport commits as `git format-patch` files here (a new or empty directory)",
    )
    p.add_argument("--image", metavar="BASE",
                   help="layer the patched wheel over BASE, an image pinned by digest "
                        "(name[:tag]@sha256:<hex>): a Containerfile, an OCI layer built offline, an image "
                        "OpenVEX (needs --image-out)")
    p.add_argument("--image-out", metavar="DIR", help="where --image writes (a new or empty directory)")
    p.add_argument("--base-layout", metavar="DIR",
                   help="BASE as an OCI image layout (skopeo copy docker://BASE oci:DIR): the output is then "
                        "a complete image layout; without it, the layer and a manifest fragment")
    p.add_argument("--site-packages", metavar="PATH",
                   help="BASE's site-packages (found in --base-layout; needed without it)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("sign", help="sign a bundle's receipt: a DSSE envelope, receipt.dsse.json")
    p.add_argument("bundle", metavar="BUNDLE")
    p.add_argument("--key", metavar="KEY", required=True,
                   help="PEM private key, unencrypted (openssl genpkey -algorithm ed25519 -out KEY)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sign)
