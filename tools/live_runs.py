"""The live table's data: what each pinned release's `run --live` bundle showed, one record per release.

A maintainer tool beside tools.docsgen (which renders docs/generated/live.md from the records):

    .venv/bin/python -m tools.live_runs BUNDLE...   # verify each bundle, record its live tier

Bundles are too large to commit (~0.6 MB each), so a record keeps what the table shows and the
receipt's sha256 and the toolkit commit that wrote it: whoever holds the bundle can check the row
against it. A bundle `verify` rejects, one without a live tier, or one a checkout with uncommitted
changes wrote, is refused (exit 2); a release
keeps the record of its newest bundle. tests/test_live_runs.py checks every record (a pinned
release, each pair verdict the one the roles' verdicts give, the result the pair verdicts give).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from backport.errors import BadInput

REPO = Path(__file__).resolve().parent.parent
RECORDS = REPO / "tests" / "data" / "live-runs.json"
ROLES = ("pristine", "patched", "reference")


def record(bundle: Path) -> dict:
    """One release's record from a bundle `verify` accepts and whose run had a live tier."""
    from backport.evidence.verify import verify

    result = verify(bundle)
    if not result.ok:
        raise BadInput(f"{bundle}: verify rejects it ({result.problems[0]}); only verified bundles are "
                       "recorded")
    receipt_bytes = (bundle / "receipt.json").read_bytes()
    predicate = json.loads(receipt_bytes)["predicate"]
    if predicate["toolkit"]["git_dirty"]:
        raise BadInput(f"{bundle}: written by a checkout with uncommitted changes (no commit names its code)")
    live = predicate.get("live")
    if not live or not live.get("scenarios"):
        raise BadInput(f"{bundle}: no live tier in this bundle (run it with --live)")
    sides = {role: json.loads((bundle / path).read_text()) for role, path in live["files"].items()}
    version = sides["pristine"]["version"]
    return {
        "version": version,
        "result": predicate["summary"]["result"],
        "setup": sides["pristine"]["server"]["flags"]["setup"]["name"],
        "backend": sides["pristine"]["server"]["backend"],
        "ready_seconds": {role: sides[role]["startup_seconds"] for role in ROLES if role in sides},
        "scenarios": {s["scenario"]: {**{r: s["verdicts"].get(r) for r in ROLES}, "pair": s["pair"],
                                      "must_preserve": s["must_preserve"]} for s in live["scenarios"]},
        "toolkit_commit": predicate["toolkit"]["git_commit"],
        "toolkit_dirty": predicate["toolkit"]["git_dirty"],
        "finished": predicate["timestamps"]["finished"],
        "receipt_sha256": hashlib.sha256(receipt_bytes).hexdigest(),
    }


def load() -> dict[str, dict]:
    return json.loads(RECORDS.read_text()) if RECORDS.is_file() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.live_runs")
    parser.add_argument("bundles", nargs="+", type=Path, help="bundle directories `run --live` wrote")
    args = parser.parse_args(argv)
    records = load()
    try:
        new = [record(b) for b in args.bundles]
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for row in new:
        old = records.get(row["version"])
        if old is None or old["finished"] <= row["finished"]:
            records[row["version"]] = row
    ordered = dict(sorted(records.items(), key=lambda kv: _version_key(kv[0])))
    RECORDS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RECORDS.with_suffix(".tmp")
    tmp.write_text(json.dumps(ordered, indent=1, sort_keys=True) + "\n")
    tmp.replace(RECORDS)
    for row in new:
        print(f"{row['version']}: {row['result']}, {len(row['scenarios'])} live scenarios recorded")
    return 0


def _version_key(version: str):
    from packaging.version import Version

    return Version(version)


if __name__ == "__main__":
    raise SystemExit(main())
