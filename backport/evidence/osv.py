"""merge's advisory feed: one OSV record per vulnerability class (`osv/<id>.json`), the form
osv-scanner and pip-audit-style tools read, as downstream rebuilders publish for their suffixed
versions.

What a record says comes from the merged bundles only (docs/vex-and-ci.md, "An advisory feed"):

- `id`: `x_<SBP id>` (OSV's prefix for a database nobody aggregates; the schema admits no other
  for an unregistered one), `aliases` the class's CVE/GHSA ids;
- `affected`: one entry per release whose pristine tree a bundle showed exposed (a case outside
  the must-preserve set unsafe on it); its range is `introduced` the release and `fixed` the
  exported `+backport.N` version when the bundle's own VEX says `fixed` for that wheel (PEP 440
  sorts `0.5.19 < 0.5.19+backport.N < 0.5.19.post1`), else `last_affected` the release (no
  backport wheel: the release stays exposed). A release no bundle showed exposed is not claimed;
- `references`: the class's references and its fixes' PRs (`FIX`);
- `modified`: the newest Last-Update of the class's patches (the pack's date, as the VEX
  documents' timestamp), so the same bundles give the same bytes.

Each record is validated against OSV's own schema (evidence/osv.schema.json, vendored with its
source and licence noted in docs/vex-and-ci.md).
"""

from __future__ import annotations

import json
from functools import cache

from packaging.version import Version

from backport import resources
from backport.errors import Finding
from backport.evidence import jsonschemas
from backport.evidence.statement import first_schema_error, schema_place
from backport.vocab import TreeVerdict, VexStatus

SCHEMA_VERSION = "1.7.5"  # the OSV schema version of the vendored schema file (its docs/schema.md)
FOLDER = "osv"
PACKAGE = {"ecosystem": "PyPI", "name": "sglang", "purl": "pkg:pypi/sglang"}


def record_id(class_id: str) -> str:
    return f"x_{class_id}"


def exposed_on_pristine(row: dict, cases: list[dict]) -> bool:
    """A case of the class outside the must-preserve set was unsafe on the upstream release."""
    return any(c["probe"] in row["probes"] and not c["must_preserve"]
               and c["verdicts"].get("pristine") == TreeVerdict.UNSAFE for c in cases)


def _timestamp(day_or_time: str) -> str:
    """OSV's form: UTC with a `Z` (the schema's pattern has no offset form)."""
    if "T" not in day_or_time:
        return f"{day_or_time}T00:00:00Z"
    return day_or_time.replace("+00:00", "Z")


def _references(row: dict) -> list[dict]:
    found: list[dict] = []
    for url in row["references"]:
        item = {"type": "REPORT" if "/issues/" in url else "WEB", "url": url}
        if item not in found:
            found.append(item)
    for urls in (row.get("fix_urls") or {}).values():
        found += [{"type": "FIX", "url": u} for u in urls if {"type": "FIX", "url": u} not in found]
    return found


def records(bundles: list[dict]) -> dict[str, dict]:
    """{file name under osv/: record} from the merged bundles, each given as `release`, `product`
    (the wheel's version or None), `statuses` (SBP id -> the bundle's OpenVEX status), `classes`
    (its standards.json classes), `cases` (its receipt's case rows) and `timestamp` (its VEX's)."""
    by_class: dict[str, dict] = {}
    affected: dict[str, list[dict]] = {}
    for bundle in bundles:
        for row in bundle["classes"]:
            by_class.setdefault(row["id"], row)
            if not exposed_on_pristine(row, bundle["cases"]):
                continue
            release, product = bundle["release"], bundle["product"]
            fixed = product is not None and bundle["statuses"].get(row["id"]) == VexStatus.FIXED
            events = [{"introduced": release}, {"fixed": product} if fixed else {"last_affected": release}]
            entry = {"package": dict(PACKAGE), "ranges": [{"type": "ECOSYSTEM", "events": events}],
                     "database_specific": {"release": release, "backport": product if fixed else None}}
            if entry not in affected.setdefault(row["id"], []):
                affected[row["id"]].append(entry)
    found = {}
    newest = max((b["timestamp"] for b in bundles), default="")
    for class_id, row in sorted(by_class.items()):
        entries = sorted(affected.get(class_id, []), key=lambda e: Version(e["database_specific"]["release"]))
        if not entries:
            continue  # no bundle showed this class on a release: nothing to advise
        record = {
            "schema_version": SCHEMA_VERSION,
            "id": record_id(class_id),
            "modified": _timestamp(row.get("last_update") or newest),
            "aliases": sorted(row["aliases"]),
            "summary": row["title"],
            "details": f"{row['description']}\n\nFixes: {', '.join(row['fixes'])}. A release is listed when "
                       f"a merged bundle showed the class unsafe on its upstream tree; its `+backport.N` "
                       f"wheel is `fixed` when that bundle's VEX says so (sglang-backport merge).",
            "affected": entries,
            "references": _references(row),
            "database_specific": {"sglang_backport": {
                "class": class_id, "name": row["name"], "upstream_fixed_in": row.get("upstream_fixed_in"),
                "pack_reach": row.get("pack_reach")}},
        }
        error = schema_error(record)
        if error:
            raise Finding(f"{FOLDER}/{record['id']}.json: {error} (a toolkit bug: nothing written)")
        found[f"{record['id']}.json"] = record
    return found


@cache
def _validator():
    schema = json.loads(resources.osv_schema().read_text())
    jsonschema = jsonschemas.load()
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    return jsonschema.Draft202012Validator(schema, format_checker=checker)


def schema_error(record: object) -> str | None:
    """Where a record departs from the OSV schema (None: it matches)."""
    error = first_schema_error(_validator(), record)
    if error is None:
        return None
    return f"does not match the OSV schema at {schema_place(error)}: {error.message[:200]}"
