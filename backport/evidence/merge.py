"""Fan-out and fan-in for CI: shards of the release matrix, and one merged view of many bundles.

`shards` cuts the pinned releases (releases.py) into jobs of K releases each, oldest first, so
that one CI job builds the probe environment once for several releases. `merge` takes bundles
that verify and writes, in one folder:

- ``vex.openvex.json``: one OpenVEX document with one statement per (vulnerability class,
  product) of every bundle, each as the bundle's own statement says it;
- ``attestations.intoto.jsonl``: every signed bundle's attestation lines (receipt and wheel),
  in bundle order; an unsigned bundle adds none and is named in the summary;
- ``summary.json`` and ``summary.md``: a release x fix table (what the engine did with each
  fix), each class's VEX status and the run's result, one row per bundle.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from packaging.version import Version

from backport.errors import BadInput, Finding
from backport.evidence.layout import ATTESTATION_SUFFIX, RECEIPT, canonical_json

MERGED_VEX = "vex.openvex.json"
MERGED_LINES = "attestations.intoto.jsonl"
SUMMARY_JSON, SUMMARY_MD = "summary.json", "summary.md"
_CELL = {"applied": "applied", "already-present": "present", "not-applicable": "-", "failed": "FAILED"}


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


def _row(bundle: Path) -> dict:
    receipt = json.loads((bundle / RECEIPT).read_bytes())
    p = receipt["predicate"]
    vex_path = bundle / "vex.openvex.json"
    document = json.loads(vex_path.read_bytes()) if vex_path.is_file() else None
    wheel = (p.get("export") or {}).get("wheel")
    return {
        "bundle": str(bundle),
        "release": p["inputs"]["trees"]["pristine"]["version"],
        "spec": p["inputs"]["target"]["spec"],
        "product": wheel["version"] if wheel else None,
        "result": p["summary"]["result"],
        "fixes": {x["fix"]: x["status"] for x in (p.get("apply") or {}).get("patches", [])},
        "vex": {s["vulnerability"]["name"]: s["status"] for s in (document or {}).get("statements", [])},
        "signed": any(bundle.rglob("*" + ATTESTATION_SUFFIX)),
        "document": document,
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
              "release, `-` = not applicable), each vulnerability class's VEX status, and the run's result."), "",
             "| release | product | " + " | ".join(fixes) + " | " + " | ".join(classes) + " | result | signed |",
             "|" + " --- |" * (len(fixes) + len(classes) + 4)]
    for row in rows:
        cells = [_CELL.get(row["fixes"].get(f, ""), row["fixes"].get(f, "")) for f in fixes]
        status = [row["vex"].get(c, "") for c in classes]
        lines.append(f"| {row['release']} | {row['product'] or '(tree only)'} | " + " | ".join(cells) + " | "
                     + " | ".join(status) + f" | {row['result']} | {'yes' if row['signed'] else 'no'} |")
    return "\n".join(lines) + "\n"


def merge(bundles: list[Path], out: Path) -> dict:
    """Write the merged files of `bundles` (each already verified by the caller) into `out`."""
    from backport import cache

    rows = sorted((_row(b) for b in bundles), key=lambda r: (Version(r["release"]), r["bundle"]))
    fixes: list[str] = []
    classes: list[str] = []
    for row in rows:
        fixes += [f for f in row["fixes"] if f not in fixes]
        classes += [c for c in row["vex"] if c not in classes]
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(p.name not in (MERGED_VEX, MERGED_LINES, SUMMARY_JSON, SUMMARY_MD)
                                                 for p in out.iterdir())):
        raise BadInput(f"{out}: exists and holds other files than a merge writes; refusing to write there")
    out.mkdir(parents=True, exist_ok=True)
    document = merged_vex(rows)
    if document is not None:
        cache.write_file_atomic(out / MERGED_VEX, canonical_json(document))
    lines = b"".join(path.read_bytes() for row in rows
                     for path in sorted(Path(row["bundle"]).rglob("*" + ATTESTATION_SUFFIX)))
    cache.write_file_atomic(out / MERGED_LINES, lines)
    table = [{k: v for k, v in row.items() if k != "document"} for row in rows]
    summary = {"bundles": len(rows), "fixes": fixes, "classes": classes, "rows": table,
               "vex_statements": len(document["statements"]) if document else 0,
               "attestations": lines.count(b"\n"), "unsigned": [r["bundle"] for r in rows if not r["signed"]]}
    cache.write_file_atomic(out / SUMMARY_JSON, canonical_json(summary))
    cache.write_file_atomic(out / SUMMARY_MD, summary_markdown(rows, fixes, classes).encode())
    return {**summary, "out": str(out)}
