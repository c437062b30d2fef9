"""What a receipt is about: its in-toto subjects, and the deployable files `run --export` adds.

The statement's subjects are the artifacts an operator deploys or rebuilds, not the bundle's
own files:

- ``patched-tree/sglang``: the patched `sglang/` package, by its tree digest (the sha256 of the
  `sha256sum` manifest of `sglang/` that `sglang-backport status` prints); in an exposure run
  (no variant for the release, no patched tree) ``pristine-tree/sglang``, the release as shipped;
- with `--export`, every exported file by its place in the bundle: the patched wheel
  ``export/sglang-X+backport.N-<tags>.whl`` and the `git format-patch` series
  ``export/patches/NNNN-*.patch``.

The bundle's own files are listed, with their sha256, in ``predicate.files`` (and in
SHA256SUMS), so a signature over the statement still covers every byte of the bundle.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from backport.evidence.layout import product_role, sha256_bytes
from backport.evidence.problem import Problem
from backport.tree import is_package_source
from backport.vocab import PatchStatus

if TYPE_CHECKING:  # export/ imports this module: the type only
    from backport.export.wheel import ExportedWheel

TREE_SUBJECT = "patched-tree/sglang"


def tree_subject_name(role: str) -> str:
    return f"{role}-tree/sglang"
EXPORT_DIR = "export"
PATCHES_DIR = f"{EXPORT_DIR}/patches"
TREE_DIGEST_METHOD = "sha256 of the sha256sum manifest of sglang/ (sglang-backport status)"
PROVENANCE = (
    "sglang_backport.json"  # the exported wheel's record, in its dist-info (export/wheel.py writes it)
)


@dataclass(frozen=True)
class Exported:
    """The files `run --export` puts in a bundle (bundle path -> bytes) and what the receipt says
    of them (``predicate.export``)."""

    files: dict[str, bytes] = field(default_factory=dict)
    record: dict | None = None


def export_of(wheel: ExportedWheel, wheel_bytes: bytes, patches: list[tuple[str, bytes]], *,
              label: str, patch_set_sha256: str) -> Exported:
    """`wheel`: the exported wheel (its to_json is what the receipt says of it); `patches` are
    (file name, bytes) in series order."""
    name = f"{EXPORT_DIR}/{wheel.name}"
    files: dict[str, bytes] = {name: wheel_bytes}
    record: dict = {"label": label, "patch_set_sha256": patch_set_sha256,
                    "wheel": {**wheel.to_json(), "file": name},
                    "patches": []}
    for file_name, data in patches:
        name = f"{PATCHES_DIR}/{file_name}"
        files[name] = data
        record["patches"].append({"file": name, "sha256": sha256_bytes(data)})
    return Exported(files, record)


def tree_digest(subject: dict) -> str | None:
    """A tree subject's tree digest: `dirHash1` (format 4), `sha256` in format 3's receipts."""
    digest = subject.get("digest") or {}
    return digest.get("dirHash1", digest.get("sha256"))


def subjects(
    patched_tree_digest: str, version: str, export: dict | None, *, role: str = "patched",
    git_tree: str | None = None, pointing: bool = True,
) -> list[dict]:
    """The statement's subjects. A tree carries the digests the attestations give it (attestations.py):
    `dirHash1` and, for a git tree, `gitTree`; format 3 (`pointing` False) labelled the tree digest
    `sha256`, which no file has."""
    digest = {"dirHash1": patched_tree_digest, **({"gitTree": git_tree} if git_tree else {})} if pointing \
        else {"sha256": patched_tree_digest}
    found = [{"name": tree_subject_name(role), "digest": digest,
              "annotations": {"version": version, "digest_of": TREE_DIGEST_METHOD}}]
    if export:
        if export.get("wheel"):
            found.append({"name": export["wheel"]["file"], "digest": {"sha256": export["wheel"]["sha256"]}})
        found += [{"name": p["file"], "digest": {"sha256": p["sha256"]}} for p in export.get("patches") or []]
    return sorted(found, key=lambda s: s["name"])


def statement_problems(statement: dict) -> list[str]:
    """The subjects against the predicate: the patched tree's digest, each export's file digest."""
    p = statement["predicate"]
    role = product_role(p["inputs"]["trees"])
    patched = p["inputs"]["trees"].get(role) or {}
    export = p.get("export")
    version = p.get("schema_version")
    pointing = isinstance(version, int) and version >= 4
    expected = subjects(patched.get("tree_digest", ""), patched.get("version", ""), export, role=role,
                        git_tree=patched.get("git_tree"), pointing=pointing)
    got = statement["subject"]
    problems = []
    if [s.get("name") for s in got] != [s["name"] for s in expected]:
        problems.append(f"subject names {[s.get('name') for s in got]}; the predicate gives "
                        f"{[s['name'] for s in expected]}")
        return problems
    for have, want in zip(got, expected, strict=True):
        if have.get("digest") != want["digest"]:
            problems.append(
                f"subject {want['name']}: digest {have.get('digest')} is not the predicate's {want['digest']}"
            )
        if have.get("annotations", want.get("annotations")) != want.get("annotations"):
            problems.append(f"subject {want['name']}: annotations disagree with inputs.trees.{role}")
    files = p.get("files") or {}
    if export:
        wheel = export.get("wheel")
        if wheel is not None:
            if files.get(wheel["file"]) != wheel["sha256"]:
                problems.append(f"export.wheel.sha256 is {wheel['sha256']}, predicate.files records "
                                f"{files.get(wheel['file'])} for {wheel['file']}")
            if wheel.get("tree_digest") != patched.get("tree_digest"):
                problems.append(
                    f"export.wheel.tree_digest {wheel.get('tree_digest')} is not the patched tree's "
                    f"{patched.get('tree_digest')}"
                )
        for item in export.get("patches") or []:
            if files.get(item["file"]) != item["sha256"]:
                problems.append(f"export.patches: {item['file']} sha256 {item['sha256']}, predicate.files "
                                f"records {files.get(item['file'])}")
        applied = [x for x in p.get("inputs", {}).get("patches") or []
                   if x.get("status") == PatchStatus.APPLIED]
        if len(export.get("patches") or []) != len(applied):
            problems.append(f"export.patches has {len(export.get('patches') or [])} files for "
                            f"{len(applied)} applied patches")
    return problems


def read_wheel(data: bytes) -> tuple[str, dict | None]:
    """(the tree digest of the `sglang/` package a wheel installs, its version label taken out: the
    same manifest as the patched tree's;
    its dist-info's export record, None when it has none)."""
    from backport.export.label import unlabelled_digest  # the label in sglang/_version.py comes back out

    with zipfile.ZipFile(io.BytesIO(data)) as wheel:
        members, provenance = [], None
        for info in wheel.infolist():
            name = info.filename
            top, _, rest = name.partition("/")
            if top == "sglang" and not info.is_dir() and is_package_source(name):
                members.append((name, wheel.read(info), None))
            elif top.endswith(".dist-info") and rest == PROVENANCE:
                provenance = json.loads(wheel.read(info))
    return unlabelled_digest(members, (provenance or {}).get("version")), provenance


def bundle_problems(bundle: Path, statement: dict) -> list[Problem]:
    """The exported wheel's content against the receipt: the `sglang/` it installs is the patched
    tree, and its provenance record names the same patch set and version."""
    export = statement["predicate"].get("export") or {}
    wheel = export.get("wheel")
    if not wheel:
        return []
    name = wheel["file"]
    try:
        digest, provenance = read_wheel((bundle / name).read_bytes())
        provenance = provenance or {}
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        return [Problem(name, "modified", f"not a readable wheel ({exc})")]
    problems = []
    if digest != wheel.get("tree_digest"):
        problems.append(
            Problem(
                name,
                "modified",
                f"installs a sglang/ of tree digest {digest}, the receipt's "
                f"patched tree is {wheel.get('tree_digest')}",
            )
        )
    for key, want in (("version", wheel.get("version")), ("tree_digest", wheel.get("tree_digest")),
                      ("patch_set_sha256", export.get("patch_set_sha256"))):
        if provenance.get(key) != want:
            problems.append(Problem(name, "modified", f"its {PROVENANCE} says {key} {provenance.get(key)!r}, "
                                                      f"the receipt {want!r}"))
    return problems


def render(statement: dict) -> list[str]:
    """REPORT.md's section on the statement's subjects and the exported files."""
    lines = ["## Subjects", "", "What this receipt is about (its in-toto subjects):", ""]
    for s in statement["subject"]:
        if s["name"].endswith("-tree/sglang"):  # the patched tree, or an exposure run's pristine tree
            lines.append(
                f"- `{s['name']}` (sglang {s.get('annotations', {}).get('version')}): tree digest "
                f"`{tree_digest(s)}`, the {TREE_DIGEST_METHOD}"
                + (f"; git tree `{s['digest']['gitTree']}`" if s["digest"].get("gitTree") else "")
            )
        else:
            lines.append(f"- `{s['name']}`: sha256 `{s['digest']['sha256']}`")
    export = statement["predicate"].get("export")
    lines.append("")
    if not export:
        lines.append("Nothing exported (`run --export` adds the patched wheel and the patch series).")
        return lines + [""]
    wheel = export["wheel"]
    lines.append(
        f"Exported wheel `{wheel['file']}`: version {wheel['version']}, built from upstream's "
        f"`{wheel['original']}`; it installs the patched tree (`pip install --no-deps {wheel['file']}`)."
    )
    lines.append(
        f"Patch series: {len(export.get('patches') or [])} `git format-patch` files in `{PATCHES_DIR}/` "
        f"(patch set {export['patch_set_sha256'][:12]}, label {export['label']})."
    )
    return lines + [""]
