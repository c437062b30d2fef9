"""`sglang-backport verify BUNDLE...`: each bundle's integrity, and what its run found.

Integrity (backport/evidence/verify.py): every digest recomputed, the receipt consistent, and the
signature layer: without --key what needs no key (the envelope's payload is receipt.json byte
for byte, its type, every attestation and its subjects' digests); with --key the signatures too.
The result is the receipt's verdict (pass, or why not). Exit 1 when any bundle fails integrity,
and with --require-pass also when a bundle's run is not a pass (the CI fan-in's gate).
"""

from __future__ import annotations

import json
from pathlib import Path

from backport.errors import BadInput
from backport.vocab import RunResult


def _document(result, state: str) -> dict:
    from backport.evidence.verify import finding_reason

    summary = result.summary
    return {**result.to_json(), "signature": state, "integrity": "ok" if result.ok else "failed",
            "result": summary["result"] if summary else None,
            "finding": finding_reason(summary) if summary else None}


def _line(path: Path, document: dict) -> str:
    if document["integrity"] == "ok":
        s = document["summary"]
        result = document["result"] + (f": {document['finding']}" if document["finding"] else "")
        return (f"OK {path}: {document['files']} files match SHA256SUMS and the receipt; receipt consistent "
                f"(run result: {result}, {s.get('cases')} cases); {document['signature']}")
    first = document["first"]
    more = f" (+{len(document['problems']) - 1} more)" if len(document["problems"]) > 1 else ""
    return f"FAIL {first['file']}: {first['kind']}: {first['detail']}{more}"


def cmd_verify(args) -> int:
    """One bundle: its verdict as before. Several (CI fan-in): one JSON verdict over all of them;
    every bundle is checked, none stops the others."""
    paths = [Path(b) for b in args.bundle]
    for path in paths:
        if not path.is_dir():
            raise BadInput(f"{path}: not a directory")
    from backport.evidence import sign  # after the check that needs none of it
    from backport.evidence.verify import verify_signed

    key = sign.load_public_key(Path(args.key)) if args.key else None  # a bad key is bad input, checked first
    documents = [_document(*verify_signed(path, key)) for path in paths]
    failed = [d["bundle"] for d in documents if d["integrity"] != "ok"]
    not_pass = [d["bundle"] for d in documents if d["integrity"] == "ok" and d["result"] != RunResult.PASS]
    ok = not failed and not (args.require_pass and not_pass)
    if args.json:
        document = documents[0] if len(paths) == 1 else {
            "ok": ok, "bundles": documents, "failed": failed, "not_pass": not_pass}
        print(json.dumps(document, indent=2, sort_keys=True))
    else:
        for path, document in zip(paths, documents):
            line = _line(path, document)
            print(line if len(paths) == 1 or document["integrity"] == "ok" else f"{path}: {line}")
        if args.require_pass and not_pass:
            print(f"not a pass (--require-pass): {', '.join(not_pass)}")
    return 0 if ok else 1


def register(sub) -> None:
    p = sub.add_parser("verify", help="recompute every digest of an evidence bundle and re-check its receipt")
    p.add_argument(
        "bundle",
        metavar="BUNDLE",
        nargs="+",
        help="one or more bundles (several: one JSON verdict, exit 1 if any fails)",
    )
    p.add_argument(
        "--key",
        metavar="PUB",
        help="also check the signatures of the bundle's envelope "
        "(receipt.dsse.json) and attestations (*.intoto.jsonl) with this "
        "PEM public key; without it all but the signatures is checked",
    )
    p.add_argument("--require-pass", action="store_true",
                   help="exit 1 also when a bundle verifies but its run is not a pass (a finding)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)
