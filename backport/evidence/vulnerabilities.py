"""The vulnerability classes this pack addresses (`patches/vulnerabilities.toml`) and the status
a bundle's cases support for each of them.

The classes file is the one place that says which fixes and which probe modules belong to
which class. A bundle carries the classes it was judged with in `vulnerabilities.json`
(under SHA256SUMS and the receipt), with two facts derived from the pack and the release
matrix: the first pinned upstream release that ships every fix of the class, and the first
pinned release this pack's backports reach. The VEX documents (vex.py, cyclonedx.py) are a
function of that file and the receipt, so `verify` rebuilds them and compares.

The status of a class on the patched tree, from the pair verdicts of the class's cases:

- ``under_investigation``: no case shows the exposure and a case errored (the probe could not
  judge the tree), or only a must-preserve case regressed (the exposure is closed, something the fix must keep
  broke), or no case of the class ran at all (every one `not-applicable`);
- ``affected``: a case outside the must-preserve set is unsafe on the patched tree, whatever else
  errored (in an exposure
  run, where the pack has no variant for the release, on the pristine tree: the one that runs);
- ``fixed``: every case is fixed, held or added (or not-applicable), and at least one ran;
- ``not_affected`` (justification ``vulnerable_code_not_present``): no case ran and the class
  names the fix whose code brings the vulnerable code (`introduced_with`, an OSV "introduced"
  event stated as a fix), and the tree the status speaks for has none of it: the release does
  not ship it (`fixed_in`) and the pack applied none. A class without `introduced_with` stays
  ``under_investigation`` when nothing ran: a case that could not run proves nothing absent.

A class may name its live scenarios (`live`): where the bundle ran the live tier, their verdicts are
cited in the notes, and one unsafe on the product tree's deployment makes the class ``affected``.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.version import Version

from backport.errors import BadInput
from backport.vocab import Cause, PairVerdict, PatchStatus, TreeVerdict, VexStatus

if TYPE_CHECKING:
    from backport.pack.model import Pack, PatchVariant

FILE = "vulnerabilities.toml"
BUNDLE_FILE = "vulnerabilities.json"
CLASS_ID = re.compile(r"^SBP-\d{4}-\d{4}$")
ALIAS = re.compile(r"^(CVE-\d{4}-\d{4,}|GHSA(-[23456789cfghjmpqrvwx]{4}){3})$")
_KEYS = {"id": str, "name": str, "title": str, "description": str, "fixes": list, "probes": list,
         "references": list, "aliases": list}
# introduced_with: the fix whose code brings the vulnerable code (see the docstring); live: the live
# tier's scenarios that show the class on a real PD deployment (cited, and an unsafe one is an exposure)
_OPTIONAL = {"introduced_with": str, "live": list}
# the keys with_releases and with_dates add to a class (standards.json carries them)
_DERIVED = ("upstream_fixed_in", "pack_reach", "fix_urls", "last_update")
_CLEAN = {PairVerdict.FIXED, PairVerdict.HELD, PairVerdict.ADDED, PairVerdict.NOT_APPLICABLE}


def _fail(path: Path, where: str, what: str) -> BadInput:
    return BadInput(f"{path}: {where}: {what}")


@dataclass(frozen=True)
class VulnClass:
    """One class of vulnerabilities.toml as the stages hand it on: the row as written (checked by
    `load_classes`), then the facts derived from the pack and the release matrix (`with_releases`,
    `with_dates`). The bundle's standards.json carries `to_json()`, which the VEX writers read back as
    the document it is; None-valued optional keys of the file are absent there, as they are in the file."""

    id: str
    name: str
    title: str
    description: str
    fixes: tuple[str, ...]
    probes: tuple[str, ...]
    references: tuple[str, ...]
    aliases: tuple[str, ...]
    introduced_with: str | None = None
    live: tuple[str, ...] | None = None
    upstream_fixed_in: str | None = None   # derived (with_releases); None also when nothing ships it
    pack_reach: str | None = None          # derived (with_releases)
    fix_urls: dict[str, list[str]] | None = None  # derived (with_releases): None until derived
    last_update: str | None = None         # derived (with_dates)
    derived: frozenset[str] = frozenset()  # which derived keys the document carries

    @classmethod
    def from_json(cls, row: dict) -> VulnClass:
        """A checked row of the file, or a class of a bundle's standards.json (with its derived keys)."""
        derived = frozenset(k for k in _DERIVED if k in row)
        return cls(id=row["id"], name=row["name"], title=row["title"], description=row["description"],
                   fixes=tuple(row["fixes"]), probes=tuple(row["probes"]),
                   references=tuple(row["references"]),
                   aliases=tuple(row["aliases"]), introduced_with=row.get("introduced_with"),
                   live=None if "live" not in row else tuple(row["live"]),
                   upstream_fixed_in=row.get("upstream_fixed_in"), pack_reach=row.get("pack_reach"),
                   fix_urls=None if row.get("fix_urls") is None else dict(row["fix_urls"]),
                   last_update=row.get("last_update"), derived=derived)

    def to_json(self) -> dict:
        doc: dict = {"id": self.id, "name": self.name, "title": self.title, "description": self.description,
                     "fixes": list(self.fixes), "probes": list(self.probes),
                     "references": list(self.references),
                     "aliases": list(self.aliases)}
        if self.introduced_with is not None:
            doc["introduced_with"] = self.introduced_with
        if self.live is not None:
            doc["live"] = list(self.live)
        for key in sorted(self.derived):
            doc[key] = getattr(self, key)
        return doc


def load_classes(series_dir: Path, fix_ids: list[str] | None = None) -> list[VulnClass]:
    """The classes of `series_dir/vulnerabilities.toml`, checked (bad input names the row)."""
    path = Path(series_dir) / FILE
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"{path}: missing (a pack names the vulnerability classes it addresses)") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"{path}: cannot read ({exc})") from None
    rows = data.get("class")
    if set(data) != {"class"} or not isinstance(rows, list) or not rows:
        raise BadInput(f"{path}: expected [[class]] tables only")
    seen_fixes: dict[str, str] = {}
    seen_probes: dict[str, str] = {}
    classes = []
    for index, row in enumerate(rows):
        where = f"class #{index + 1}"
        if not isinstance(row, dict) or not set(_KEYS) <= set(row) <= set(_KEYS) | set(_OPTIONAL):
            raise _fail(path, where, f"needs exactly the keys {', '.join(_KEYS)} (and may have "
                                     f"{', '.join(_OPTIONAL)})")
        if not isinstance(row.get("introduced_with", ""), str):
            raise _fail(path, where, "introduced_with must be a string")
        if not isinstance(row.get("live", []), list) or not all(
            isinstance(x, str) for x in row.get("live", [])
        ):
            raise _fail(path, where, "live must be a list of live scenario names")
        if fix_ids is not None and "introduced_with" in row and row["introduced_with"] not in fix_ids:
            raise _fail(path, where, f"introduced_with {row['introduced_with']!r} is not in fixes.toml")
        for key, kind in _KEYS.items():
            if not isinstance(row[key], kind) or (
                kind is list and not all(isinstance(x, str) for x in row[key])
            ):
                raise _fail(path, where, f"{key} must be a {kind.__name__} of strings" if kind is list
                            else f"{key} must be a string")
        where = f"class {row['id']}"
        if not CLASS_ID.fullmatch(row["id"]):
            raise _fail(path, where, "id must look like SBP-YYYY-NNNN (this project's own id)")
        for alias in row["aliases"]:
            if not ALIAS.fullmatch(alias):
                raise _fail(path, where, f"alias {alias!r} is not a CVE-... or GHSA-... id")
        if not row["references"] or not all(r.startswith("https://") for r in row["references"]):
            raise _fail(path, where, "references must be https URLs (at least one)")
        for key, seen in (("fixes", seen_fixes), ("probes", seen_probes)):
            for item in row[key]:
                if item in seen:
                    raise _fail(path, where, f"{key[:-1]} {item!r} already belongs to {seen[item]}")
                seen[item] = row["id"]
            if fix_ids is not None and key == "fixes":
                unknown = [f for f in row[key] if f not in fix_ids]
                if unknown:
                    raise _fail(path, where, f"fix {unknown[0]!r} is not in fixes.toml")
        classes.append(VulnClass.from_json(row))
    if fix_ids is not None:
        missing = [f for f in fix_ids if f not in seen_fixes]
        if missing:
            raise BadInput(f"{path}: fix {missing[0]!r} belongs to no vulnerability class")
    return classes


def with_releases(classes: list[VulnClass], fixes: dict, versions: list[str]) -> list[VulnClass]:
    """Each class with `upstream_fixed_in` (the first of `versions` that ships every fix of the
    class it needs; None: none does) and `pack_reach` (the first that ships or gets a backport of
    each). A release needs every upstream fix of the class, and the pack's own (vendor) fixes
    where their scope reaches it: upstream never ships those, and one may serve only releases an
    upstream fix cannot be carried to (sbp-abort-hold below 0.5.13), where it says nothing about
    the releases upstream fixed."""
    ordered = sorted(versions, key=Version)
    done = []
    for row in classes:
        own = [fixes[f] for f in row.fixes if f in fixes]

        def needed(v: str, own: list = own) -> list:
            return [f for f in own if f.origin != "vendor" or f.in_scope(v)]

        upstream = [v for v in ordered if needed(v) and all(f.is_fixed_in(v) for f in needed(v))]
        reach = [v for v in ordered
                 if needed(v) and all(f.is_fixed_in(v) or f.in_scope(v) for f in needed(v))]
        done.append(dataclasses.replace(
            row, upstream_fixed_in=upstream[0] if upstream else None, pack_reach=reach[0] if reach else None,
            fix_urls={f.id: [f.url] for f in own if f.url},
            derived=row.derived | {"upstream_fixed_in", "pack_reach", "fix_urls"}))
    return done


def add_aliases(classes: list[VulnClass], aliases: dict[str, list[str]]) -> list[VulnClass]:
    """Classes with more aliases (`run --vuln-alias CLASS=ID`), by class id or name."""
    known = {c.id for c in classes} | {c.name for c in classes}
    for key, ids in aliases.items():
        if key not in known:
            raise BadInput(
                f"--vuln-alias {key}=...: no vulnerability class {key!r} (known: {', '.join(sorted(known))})"
            )
        for alias in ids:
            if not ALIAS.fullmatch(alias):
                raise BadInput(f"--vuln-alias {key}={alias}: not a CVE-... or GHSA-... id")
    return [dataclasses.replace(c, aliases=tuple(sorted(set(c.aliases) | set(aliases.get(c.id, []))
                                                        | set(aliases.get(c.name, []))))) for c in classes]


def pack_classes(
    pack: Pack, releases_path: Path | None = None, aliases: Iterable[tuple[str, str]] = ()
) -> list[VulnClass] | None:
    """The classes of a loaded pack, checked against its fixes, with the release facts derived and
    the extra aliases ((class, id) pairs) added; None for a pack without a classes file (no VEX)."""
    from backport.releases import load_releases

    if not (Path(pack.root) / FILE).is_file():
        return None
    grouped: dict[str, list[str]] = {}
    for key, alias in aliases:
        grouped.setdefault(key, []).append(alias)
    classes = load_classes(pack.root, list(pack.fixes))
    classes = with_releases(classes, dict(pack.fixes), list(load_releases(releases_path)))
    return add_aliases(with_dates(classes, pack.variants), grouped)


def with_dates(classes: list[VulnClass], variants: Mapping[str, Sequence[PatchVariant]]) -> list[VulnClass]:
    """Each class with `last_update`: the newest Last-Update of its fixes' patch variants (None
    without any), the date its VEX statements speak as of."""
    found = [
        max((v.last_update for f in row.fixes for v in variants.get(f, ())), default=None)
        for row in classes
    ]
    return [dataclasses.replace(row, last_update=None if day is None else day.isoformat(),
                                derived=row.derived | {"last_update"}) for row, day in zip(classes, found)]


def issued(statement: dict, standards: dict) -> str:
    """The VEX documents' timestamp: the newest `last_update` of the classes at 00:00:00 UTC (the
    pack's date, as the patched tree's commits are dated), so that the same inputs give the same
    bytes and the run's own time stays in the receipt's predicate.timestamps; bundles written
    before classes carried it: the run's start, as they were written."""
    dates = [str(c["last_update"]) for c in standards["classes"] if c.get("last_update")]
    return f"{max(dates)}T00:00:00+00:00" if dates else statement["predicate"]["timestamps"]["started"]


@dataclass(frozen=True)
class ClassStatus:
    status: VexStatus           # an OpenVEX status
    cases: tuple[str, ...]      # probe/case of the class, in receipt order
    notes: str                  # how the status follows from the cases
    unsafe: tuple[str, ...] = ()
    tree: str = "patched"       # the tree the status speaks for (pristine in an exposure run)


def _roles(row: dict) -> list[str]:
    """A live row's roles in one order whatever its dict's order: the receipt is written with sorted
    keys, so a note built in insertion order at `run` differed from the one `verify` rebuilt."""
    order = ("pristine", "patched", "reference")
    return sorted(row["verdicts"], key=lambda r: (order.index(r) if r in order else len(order), r))


def class_status(
    row: VulnClass, cases: list[dict], apply: dict | None = None, live: dict | None = None
) -> ClassStatus:
    """The status the receipt's case rows (and its apply report, for `introduced_with`) support
    for one class (module docstring); the class's live scenarios, where they ran, are cited, and one
    unsafe on the product tree makes the class affected whatever the probes said."""
    status = _probed_status(row, cases, apply)
    scenarios = [r for r in (live or {}).get("scenarios", []) if r["scenario"] in (row.live or ())]
    if not scenarios:
        return status
    role = status.tree
    seen = "; ".join(
        f"{r['scenario']} " + ", ".join(f"{k} {r['verdicts'][k]}{_timeout_note(r, k)}" for k in _roles(r))
        for r in scenarios
    )
    unsafe = tuple(f"live/{r['scenario']}" for r in scenarios
                   if not r["must_preserve"] and r["verdicts"].get(role) == TreeVerdict.UNSAFE)
    if unsafe and status.status != VexStatus.AFFECTED:
        return ClassStatus(VexStatus.AFFECTED, status.cases,
                           f"{len(unsafe)} live scenario(s) unsafe on the {role} deployment "
                           f"(first: {unsafe[0]}); live tier: {seen}; probes: {status.notes}",
                           unsafe, role)
    return dataclasses.replace(status, notes=f"{status.notes}; live tier: {seen}")


def _timeout_note(row: dict, role: str) -> str:
    """A race run whose decode released A's pages through its deferred-release timeout is safe only
    as long as A's writes end within it (e.g. SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1 on
    a tree without the drain ACK): the notes say so, so a VEX reader never takes it for a drain ACK."""
    run = (row.get("runs") or {}).get(role) or {}
    if not run.get("released_through_timeout"):
        return ""
    return " (through decode's deferred-release timeout, not a drain ACK)"


def _probed_status(row: VulnClass, cases: list[dict], apply: dict | None) -> ClassStatus:
    own = [c for c in cases if c["probe"] in row.probes]
    names = tuple(f"{c['probe']}/{c['case']}" for c in own)
    by_pair: dict[str, list[str]] = {}
    for c in own:
        by_pair.setdefault(c["pair"], []).append(f"{c['probe']}/{c['case']}")
    counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_pair.items()))
    errored = [f"{c['probe']}/{c['case']}" for c in own if c["pair"] == PairVerdict.ERROR]
    role = _product(own)
    exposed = [f"{c['probe']}/{c['case']}" for c in own
               if not c["must_preserve"] and c["verdicts"].get(role) == TreeVerdict.UNSAFE]
    broken = [f"{c['probe']}/{c['case']}" for c in own if c["must_preserve"] and c["pair"] not in _CLEAN]
    ran = [c for c in own if c["pair"] != PairVerdict.NOT_APPLICABLE]
    if exposed:  # an unsafe case shows the exposure whatever another case could not judge
        unjudged = f"; {len(errored)} case(s) could not be judged (first: {errored[0]})" if errored else ""
        return ClassStatus(VexStatus.AFFECTED, names, f"{len(exposed)} case(s) unsafe on the {role} tree "
                           f"(first: {exposed[0]}){unjudged}; cases: {counts}", tuple(exposed), role)
    if errored:
        return ClassStatus(VexStatus.UNDER_INVESTIGATION, names,
                           f"{len(errored)} case(s) could not be judged (first: {errored[0]}); "
                           f"cases: {counts}")
    if broken:
        return ClassStatus(VexStatus.UNDER_INVESTIGATION, names, f"must-preserve case(s) regressed (first: "
                           f"{broken[0]}); cases: {counts}")
    if not ran:
        absent = _code_absent(row.introduced_with, apply)
        if absent:
            return ClassStatus(VexStatus.NOT_AFFECTED, names, f"vulnerable code not present: {absent}; the "
                               f"{len(own)} case(s) of the class need it and did not run", tree=role)
        return ClassStatus(VexStatus.UNDER_INVESTIGATION, names, "no case of this class ran on these trees "
                           f"({len(own)} not-applicable)")
    return ClassStatus(
        VexStatus.FIXED, names, f"every case of the class is fixed or held on the {role} tree: {counts}"
    )


def _code_absent(fix: str | None, apply: dict | None) -> str:
    """Why the product tree has no code of `fix` ("" when it may have some): the release does not
    ship it and the pack did not apply it (the apply report's reason says which)."""
    entry = next((p for p in (apply or {}).get("patches", []) if p.get("fix") == fix), None)
    if fix is None or entry is None:
        return ""
    if _ships(entry) or entry.get("status") in (PatchStatus.APPLIED, PatchStatus.PRESENT):
        return ""
    return f"the tree has no {fix} code (the release does not ship it; the pack: {entry.get('status')})"


def _ships(entry: dict) -> bool:
    """The release ships the fix (apply-report.json's entry): its `cause`. Only a report written
    before the cause existed is read by its prose (the engine wrote "is in fixed_in" then)."""
    if entry.get("status") != PatchStatus.NOT_APPLICABLE:
        return False
    if "cause" in entry:
        return entry["cause"] == Cause.SHIPPED
    return "fixed_in" in (entry.get("reason") or "")


def _product(cases: list[dict]) -> str:
    """The tree the statuses speak for: patched, or pristine in an exposure run (no patched tree)."""
    return "patched" if not cases or "patched" in cases[0]["verdicts"] else "pristine"


def action_statement(row: VulnClass, status: ClassStatus, version: str, apply_report: dict | None) -> str:
    """What an operator of this exposed release does (an `affected` statement must say)."""
    lacking = [
        p["fix"]
        for p in (apply_report or {}).get("patches", [])
        if p.get("fix") in row.fixes
        and (
            (p.get("status") == PatchStatus.NOT_APPLICABLE and not _ships(p))
            or (p.get("status") == PatchStatus.FAILED and not p.get("variant"))
        )
    ]
    parts = [f"sglang {version} stays exposed to {row.name} with this pack"]
    if lacking:
        parts[0] += f": it carries no backport of {', '.join(lacking)} for this release"
    parts[0] += f" ({len(status.unsafe)} case(s) unsafe on the {status.tree} tree, first {status.unsafe[0]})"
    if row.pack_reach:
        parts.append(f"move to sglang {row.pack_reach} or later and install its backport wheel "
                     f"(sglang-backport run sglang==X --export)")
    if row.upstream_fixed_in:
        parts.append(
            f"or upgrade to upstream sglang {row.upstream_fixed_in} or later, which ships every fix "
            f"of the class ({', '.join(row.fixes)})"
        )
    return "; ".join(parts) + "."
