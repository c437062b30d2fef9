"""Fan-out and fan-in for CI: shards of the release matrix, and one merged view of many bundles.

`shards` cuts the pinned releases (releases.py) into jobs of K releases each, oldest first, so
that one CI job builds the probe environment once for several releases. `merge` takes bundles
that verify and writes, in one folder:

- ``vex.openvex.json``: one OpenVEX document with one statement per (vulnerability class,
  product) of every bundle, each as the bundle's own statement says it;
- ``vex.cdx.json``: the bundles' CycloneDX VEX in one document, each `affects` a BOM-Link into its
  own bundle's sbom.cdx.json (cdxvex.aggregate), for bundles that carry one;
- ``osv/<id>.json``: one OSV record per vulnerability class, the releases the bundles showed
  exposed and their `+backport.N` wheels as fixed (osv.py);
- ``attestations.intoto.jsonl``: every signed bundle's attestation lines (receipt and wheel),
  in bundle order; an unsigned bundle adds none and is named in the summary;
- ``summary.json`` and ``summary.md``: a release x fix table (what the engine did with each
  fix), each class's VEX status, whether the live tier and upstream's tests ran, whether the
  bundle is signed, and the run's result with why it is not a pass, one row per bundle; an
  expected release without a bundle (`--expect`) is a row of its own, `missing`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from packaging.version import Version

from backport.errors import BadInput, Finding
from backport.evidence import cdxvex, osv
from backport.evidence.layout import ATTESTATION_SUFFIX, ENVELOPE, RECEIPT, canonical_json, write_readable
from backport.evidence.table import attached_from
from backport.evidence.vex import STANDARDS
from backport.vocab import PatchStatus, RunResult

OSV_FOLDER = osv.FOLDER
_PRIVATE = ("document", "cdx", "standards", "cases")  # what a row carries for the merged files, not the table

MERGED_VEX = "vex.openvex.json"
MERGED_CDX = "vex.cdx.json"
MERGED_LINES = "attestations.intoto.jsonl"
SUMMARY_JSON, SUMMARY_MD = "summary.json", "summary.md"
_CELL = {PatchStatus.APPLIED: "applied", PatchStatus.PRESENT: "present", PatchStatus.NOT_APPLICABLE: "-",
         PatchStatus.FAILED: "FAILED"}


def shards(versions: list[str], size: int) -> list[dict]:
    """`{"shard", "specs"}` per job: every version exactly once, `size` per job, oldest first."""
    if size < 1:
        raise BadInput(f"--shard-size {size}: must be 1 or more")
    ordered = sorted(versions, key=Version)
    groups = [ordered[i:i + size] for i in range(0, len(ordered), size)]
    width = len(str(len(groups)))
    return [{"shard": f"shard-{n + 1:0{width}d}", "specs": " ".join(f"sglang=={v}" for v in group),
             "releases": f"{group[0]}..{group[-1]}"} for n, group in enumerate(groups)]


def find_bundles(paths: list[Path]) -> list[Path]:
    """Every bundle (a folder with receipt.json) at or under the given paths, sorted, each once."""
    found: list[Path] = []
    for path in paths:
        path = Path(path)
        if not path.is_dir():
            raise BadInput(f"{path}: not a directory")
        hits = [path] if (path / RECEIPT).is_file() else sorted(p.parent for p in path.rglob(RECEIPT))
        if not hits:
            raise BadInput(f"{path}: holds no evidence bundle (no {RECEIPT} at or under it)")
        found += [h.resolve() for h in hits if h.resolve() not in found]
    return found


def check_out(out: Path) -> None:
    """Refuse an --out that holds anything a merge does not write (checked before any work)."""
    out = Path(out)
    if out.exists() and (
        not out.is_dir()
        or any(p.name not in (MERGED_VEX, MERGED_CDX, OSV_FOLDER, MERGED_LINES, SUMMARY_JSON, SUMMARY_MD)
               for p in out.iterdir())
    ):
        raise BadInput(
            f"--out {out}: exists and holds other files than a merge writes; refusing to write there"
        )


def _upstream_cell(up: dict | None) -> str:
    if not up or up.get("skipped"):
        return "skipped"
    ran = sum(1 for tree in up.get("trees") or [] for test in tree.get("tests") or []
              if test.get("outcome") != "skipped")
    return f"ran ({ran} tests)" if ran else "none ran"


def _release(spec: str) -> str:
    return spec.split("==", 1)[1] if spec.startswith("sglang==") else spec


def _order(row: dict) -> tuple:
    try:
        return (0, Version(row["release"]), row["bundle"] or "")
    except ValueError:  # a git or path target: after the releases, by name
        return (1, row["release"], row["bundle"] or "")


def missing_rows(expected: list[str], rows: list[dict]) -> list[dict]:
    """A row for each expected spec no bundle is of (a shard that crashed, or wrote nothing)."""
    have = {row["spec"] for row in rows}
    return [
        {
            "bundle": None,
            "release": _release(spec),
            "spec": spec,
            "product": None,
            "result": "missing",
            "why": "no bundle: its run left none",
            "fixes": {},
            "vex": {},
            "live": "-",
            "upstream_tests": "-",
            "signed": False,
            "document": None,
            "cdx": None,
            "standards": None,
            "cases": [],
        }
        for spec in dict.fromkeys(expected)
        if spec not in have
    ]


def _row(bundle: Path) -> dict:
    from backport.evidence.verify import finding_reason

    receipt = attached_from(bundle, json.loads((bundle / RECEIPT).read_bytes()))  # format 4 points at files
    p = receipt["predicate"]
    live = p.get("live")
    vex_path = bundle / "vex.openvex.json"
    document = json.loads(vex_path.read_bytes()) if vex_path.is_file() else None
    cdx_path, standards_path = bundle / cdxvex.VEX_CDX, bundle / STANDARDS
    wheel = (p.get("export") or {}).get("wheel")
    return {
        "bundle": str(bundle),
        "release": p["inputs"]["trees"]["pristine"]["version"],
        "spec": p["inputs"]["target"]["spec"],
        "product": wheel["version"] if wheel else None,
        "result": p["summary"]["result"],
        "why": finding_reason(p["summary"]),
        "live": f"yes ({len(live.get('scenarios') or [])} scenarios)" if live else "no",
        "upstream_tests": _upstream_cell(p.get("upstream_tests")),
        "fixes": {x["fix"]: x["status"] for x in (p.get("apply") or {}).get("patches", [])},
        # by the class's SBP id (the last part of the statement's @id): `name` is a CVE where one is known
        "vex": {s["vulnerability"]["@id"].rsplit("/", 1)[-1]: s["status"]
                for s in (document or {}).get("statements", [])},
        "signed": (
            bundle / ENVELOPE
        ).is_file(),  # the envelope that verify checked (and with --key, its signature)
        "document": document,
        "cdx": json.loads(cdx_path.read_bytes()) if cdx_path.is_file() else None,
        "standards": json.loads(standards_path.read_bytes()) if standards_path.is_file() else None,
        "cases": p["cases"],
    }


def merged_vex(rows: list[dict]) -> dict | None:
    from backport.evidence import vex

    statements = []
    for row in rows:
        for statement in (row["document"] or {}).get("statements", []):
            for product in statement["products"]:
                item = {**statement, "products": [product]}
                if item not in statements:  # two bundles of one product say the same thing once
                    statements.append(item)
    if not statements:
        return None
    documents = [r["document"] for r in rows if r["document"]]
    key = hashlib.sha256("".join(sorted(d["@id"] + "\n" for d in documents)).encode()).hexdigest()
    document = {"@context": vex.CONTEXT, "@id": f"{vex.SITE}/vex/merged/{key}", "author": vex.AUTHOR,
                "role": "backport maintainer", "timestamp": max(d["timestamp"] for d in documents),
                "version": 1, "tooling": documents[0].get("tooling", "sglang-backport"),
                "statements": statements}
    error = vex.schema_errors(document)
    if error:
        raise Finding(f"{MERGED_VEX}: {error} (a toolkit bug: nothing written)")
    return document


def summary_markdown(rows: list[dict], fixes: list[str], classes: list[str]) -> str:
    lines = ["# Backport matrix summary", "",
             ("One row per bundle: what the engine did with each fix (`applied`, `present` = already in the "
              "release, `-` = not applicable), each vulnerability class's VEX status, whether the live tier "
              "and upstream's unit tests ran, whether the bundle is signed, and the run's result with why it "
              "is not a pass (`missing`: an expected release left no bundle)."), "",
             "| release | product | " + " | ".join(fixes + classes)
             + " | live tier | upstream tests | signed | result | why |",
             "|" + " --- |" * (len(fixes) + len(classes) + 7)]
    for row in rows:
        cells = [_CELL.get(row["fixes"].get(f, ""), row["fixes"].get(f, "")) for f in fixes]
        status = [row["vex"].get(c, "") for c in classes]
        product = row["product"] or ("-" if row["bundle"] is None else "(tree only)")
        lines.append(f"| {row['release']} | {product} | " + " | ".join(cells + status)
                     + f" | {row['live']} | {row['upstream_tests']} | {'yes' if row['signed'] else 'no'} "
                     f"| {row['result']} | {row['why'] or ''} |")
    return "\n".join(lines) + "\n"


def merge(bundles: list[Path], out: Path, expected: list[str] | None = None) -> dict:
    """Write the merged files of `bundles` (each already verified by the caller) into `out`;
    `expected` specs without a bundle are rows of their own. `failed` in the result: every row
    that is not a pass, with why."""
    present = [_row(b) for b in bundles]
    rows = sorted(present + missing_rows(expected or [], present), key=_order)
    fixes: list[str] = []
    classes: list[str] = []
    for row in rows:
        fixes += [f for f in row["fixes"] if f not in fixes]
        classes += [c for c in row["vex"] if c not in classes]
    out = Path(out)
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    document = merged_vex(rows)
    if document is not None:
        write_readable(out / MERGED_VEX, canonical_json(document))
    cdx = cdxvex.aggregate([r["cdx"] for r in rows if r["cdx"]])
    if cdx is not None:
        write_readable(out / MERGED_CDX, cdxvex.checked_bytes(cdx, MERGED_CDX))
    elif (out / MERGED_CDX).is_file():
        (out / MERGED_CDX).unlink()  # an earlier merge's, which these bundles would not give
    feed = osv.records([
        {"release": r["release"], "product": r["product"], "statuses": r["vex"], "cases": r["cases"],
         "classes": r["standards"]["classes"], "timestamp": r["document"]["timestamp"]}
        for r in rows if r["standards"] and r["document"]])
    for stale in sorted((out / OSV_FOLDER).glob("x_*.json")) if (out / OSV_FOLDER).is_dir() else []:
        if stale.name not in feed:
            stale.unlink()  # a record an earlier merge wrote for a class these bundles do not show
    if feed:
        (out / OSV_FOLDER).mkdir(exist_ok=True)
        for name, record in feed.items():
            write_readable(out / OSV_FOLDER / name, canonical_json(record))
    lines = b"".join(path.read_bytes() for row in rows if row["bundle"] is not None
                     for path in sorted(Path(row["bundle"]).rglob("*" + ATTESTATION_SUFFIX)))
    write_readable(out / MERGED_LINES, lines)
    table = [{k: v for k, v in row.items() if k not in _PRIVATE} for row in rows]
    summary = {
        "bundles": len(present),
        "fixes": fixes,
        "classes": classes,
        "rows": table,
        "vex_statements": len(document["statements"]) if document else 0,
        "osv_records": sorted(feed),
        "attestations": lines.count(b"\n"),
        "unsigned": [r["bundle"] for r in rows if not r["signed"] and r["bundle"] is not None],
        "failed": [
            {
                "release": r["release"],
                "spec": r["spec"],
                "bundle": r["bundle"],
                "result": r["result"],
                "why": r["why"],
            }
            for r in rows
            if r["result"] != RunResult.PASS
        ],
    }
    write_readable(out / SUMMARY_JSON, canonical_json(summary))
    write_readable(out / SUMMARY_MD, summary_markdown(rows, fixes, classes).encode())
    return {**summary, "out": str(out)}
