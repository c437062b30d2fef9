"""Loading a pack: ``series``, ``fixes.toml`` and ``<fix>/*.patch`` (quilt layout).

``series``: one fix id a line, in application order; ``#`` starts a comment;
at least one fix.

``fixes.toml``: one table per fix, either ``[fixes.pr36988]`` or an
``[[fix]]`` entry with ``id = "pr36988"``. Keys (no others)::

    title = "..."                       # required, a non-empty string
    pr = 36988                          # required, an integer
    url = "https://github.com/..."      # default: the sglang pull URL of pr
    upstream_commit = "febb360519"      # required (alias: commit, merge_commit)
    fixed_in = ">=0.5.20"               # releases that already contain it; "" = none
    scope = ">=0.5.19"                  # releases the pack backports it to; default: all
    origin = "vendor"                   # this pack's own fix: no pr/upstream_commit, url is its
                                        # design reference, fixed_in must be "" (no release has it)
    depends_on = ["pr36988"]            # fix ids, default []; never itself, no cycle
    fingerprint = [{ file = "sglang/...", pattern = "regex" }]   # all must match;
                                        # a rule with absent = true must NOT match
    upstream_tests = [{ path = "test/...", rev = "<commit>", sha256 = "<64 hex>" }]  # default [];
                                        # sha256 optional (absent: unpinned), checked when present

Each patch's header must agree with its fix's entry (headers.check_agreement).
Everything malformed raises ``BadInput`` with one line naming the file and
the problem.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import re
import tomllib
from pathlib import Path
from types import MappingProxyType

from ..errors import BadInput
from .diffs import parse_diff
from .headers import check_agreement, parse_header, parse_ids
from .model import (
    FIX_ID,
    CoverageExclusion,
    FingerprintRule,
    Fix,
    Pack,
    PatchVariant,
    check_confined,
    parse_spec,
)

FIX_KEYS = frozenset(
    {
        "id",
        "title",
        "pr",
        "url",
        "bug",
        "upstream_commit",
        "commit",
        "merge_commit",
        "fixed_in",
        "scope",
        "depends_on",
        "fingerprint",
        "upstream_tests",
        "origin",
        "coverage_exclude",
    }
)
ORIGINS = ("upstream", "vendor")
RULE_KEYS = frozenset({"file", "pattern", "absent"})
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror})") from None


def load_pack(root: str | Path) -> Pack:
    """Load ``root/series``, ``root/fixes.toml`` and every ``root/<fix>/*.patch``."""
    root = Path(root)
    series_file, fixes_file = root / "series", root / "fixes.toml"
    for f in (series_file, fixes_file):
        if not f.is_file():
            raise BadInput(f"{f}: missing (a pack needs series and fixes.toml)")
    fixes = _load_fixes(fixes_file)
    series = _load_series(series_file, fixes)
    variants: dict[str, tuple[PatchVariant, ...]] = {}
    for fid in series:
        for d in fixes[fid].depends_on:
            if d in series and series.index(d) > series.index(fid):
                raise BadInput(f"{series_file}: {fid} is listed before its dependency {d}")
        fix_dir = root / fid
        files = sorted(fix_dir.glob("*.patch")) if fix_dir.is_dir() else []
        variants[fid] = tuple(load_variant(p, fid, fixes[fid]) for p in files)
        for pv in variants[fid]:  # a variant's own dependency: a fix applied before it
            for d in set(pv.depends_on) - set(fixes[fid].depends_on):
                if d not in series or series.index(d) > series.index(fid):
                    raise BadInput(f"{pv.path}: Depends-On is {', '.join(pv.depends_on)}: {d} is not a fix "
                                   f"the series applies before {fid}")
    return Pack(root=root, fixes=MappingProxyType(fixes), series=tuple(series),
                variants=MappingProxyType(variants))


def _load_series(path: Path, fixes: dict[str, Fix]) -> list[str]:
    series: list[str] = []
    for n, raw in enumerate(_read_text(path).splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line not in fixes:
            raise BadInput(f"{path}:{n}: {line!r} has no entry in fixes.toml")
        if line in series:
            raise BadInput(f"{path}:{n}: {line!r} listed twice")
        series.append(line)
    if not series:
        raise BadInput(f"{path}: lists no fix (an empty series would apply nothing and say nothing-to-do)")
    return series


def _load_fixes(path: Path) -> dict[str, Fix]:
    try:
        data = tomllib.loads(_read_text(path))
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{path}: not valid TOML ({e})") from None
    extra = sorted(set(data) - {"fixes", "fix"})
    if extra:
        raise BadInput(f"{path}: unknown top-level key {extra[0]!r} (expected [[fix]] entries)")
    entries: list[tuple[object, object]] = []
    if "fixes" in data:
        if not isinstance(data["fixes"], dict):
            raise BadInput(f"{path}: 'fixes' must be a table of [fixes.<id>] tables")
        entries += list(data["fixes"].items())
    if "fix" in data:
        if not isinstance(data["fix"], list):
            raise BadInput(f"{path}: 'fix' must be an array of [[fix]] tables")
        for entry in data["fix"]:
            if not isinstance(entry, dict) or "id" not in entry:
                raise BadInput(f"{path}: a [[fix]] entry has no id")
            entries.append((entry["id"], entry))
    if not entries:
        raise BadInput(f"{path}: no [fixes.<id>] tables or [[fix]] entries")
    out: dict[str, Fix] = {}
    for fid, table in entries:
        if not isinstance(fid, str) or not FIX_ID.match(fid):
            raise BadInput(f"{path}: {fid!r} is not a valid fix id")
        if fid in out:
            raise BadInput(f"{path}: fix {fid} defined twice")
        if not isinstance(table, dict):
            raise BadInput(f"{path} [{fid}]: not a table")
        out[fid] = _fix(fid, table, f"{path} [{fid}]")
    _check_dependencies(out, path)
    return out


def _str(e: dict, key: str, where: str, default: str | None = None) -> str:
    value = e.get(key, default)
    if value is None:
        raise BadInput(f"{where}: missing {key}")
    if not isinstance(value, str):
        raise BadInput(f"{where}: {key} must be a string, not {type(value).__name__}")
    return value


def _fix(fid: str, e: dict, where: str) -> Fix:
    unknown = sorted(set(e) - FIX_KEYS)
    if unknown:
        raise BadInput(f"{where}: unknown key {unknown[0]!r}")
    title = _str(e, "title", where)
    if not title.strip():
        raise BadInput(f"{where}: title is empty")
    origin = _str(e, "origin", where, "upstream")
    if origin not in ORIGINS:
        raise BadInput(f"{where}: origin {origin!r} is not one of {', '.join(ORIGINS)}")
    if origin == "vendor":
        pr, commit = _vendor_fields(e, where)
    else:
        if "pr" not in e:
            raise BadInput(f"{where}: missing pr")
        pr = e["pr"]
        if isinstance(pr, bool) or not isinstance(pr, int) or pr <= 0:
            raise BadInput(f"{where}: pr {pr!r} is not a positive integer")
        commit_key = next(
            (k for k in ("upstream_commit", "commit", "merge_commit") if k in e), "upstream_commit"
        )
        commit = _str(e, commit_key, where)
        if not commit.strip():
            raise BadInput(f"{where}: upstream_commit is empty")
    deps = e.get("depends_on", [])
    if not isinstance(deps, list) or not all(isinstance(x, str) for x in deps):
        raise BadInput(f"{where}: depends_on must be a list of fix ids")
    rules_in = e.get("fingerprint", [])
    if not isinstance(rules_in, list):
        raise BadInput(f"{where}: fingerprint must be a list of {{ file, pattern }} tables")
    rules = tuple(_rule(r, where) for r in rules_in)
    tests = e.get("upstream_tests", [])
    if not isinstance(tests, list):
        raise BadInput(f"{where}: upstream_tests must be a list")
    for test in tests:
        _check_test_pin(test, where)
    return Fix(
        id=fid,
        title=title,
        pr=pr,
        url=_str(e, "url", where, f"https://github.com/sgl-project/sglang/pull/{pr}"),
        upstream_commit=commit,
        fixed_in=parse_spec(_str(e, "fixed_in", where, ""), where, "fixed_in"),
        depends_on=tuple(deps),
        fingerprint=rules,
        upstream_tests=tuple(MappingProxyType(dict(t)) if isinstance(t, dict) else t for t in tests),
        scope=parse_spec(_str(e, "scope", where, ""), where, "scope"),
        origin=origin,
        coverage_exclude=_exclusions(e.get("coverage_exclude", []), where),
        bug=_bug(e, where),
    )


def _bug(e: dict, where: str) -> str:
    """The report the fix answers (a DEP-3 `Bug:`): an https URL, or "" when fixes.toml names none."""
    bug = _str(e, "bug", where, "")
    if bug and not bug.startswith("https://"):
        raise BadInput(f"{where}: bug {bug!r} is not an https URL of the report")
    return bug


def _check_test_pin(test: object, where: str) -> None:
    """An upstream test's optional `sha256` pin: 64 lowercase hex digits (absent: unpinned)."""
    if not isinstance(test, dict) or "sha256" not in test:
        return
    pin = test["sha256"]
    if not isinstance(pin, str) or not _SHA256_RE.fullmatch(pin):
        raise BadInput(f"{where}: upstream_tests {test.get('path', '?')}: sha256 {pin!r} is not 64 lowercase "
                       f"hex digits (measure it with `sglang-backport upstream-tests --print-pins`)")


def _exclusions(items: object, where: str) -> tuple[CoverageExclusion, ...]:
    """`coverage_exclude = [{ file, pattern, reason }]`: each must name a file inside sglang/, a
    valid regular expression and a non-empty reason (an exclusion is never silent)."""
    if not isinstance(items, list):
        raise BadInput(f"{where}: coverage_exclude must be a list of {{ file, pattern, reason }} tables")
    out = []
    for item in items:
        if not isinstance(item, dict) or set(item) != {"file", "pattern", "reason"} or not all(
                isinstance(v, str) and v.strip() for v in item.values()):
            raise BadInput(
                f"{where}: a coverage_exclude entry is {{ file, pattern, reason }}, all non-empty strings"
            )
        if not item["file"].startswith("sglang/"):
            raise BadInput(f"{where}: coverage_exclude file {item['file']!r} is not inside sglang/")
        try:
            re.compile(item["pattern"])
        except re.error as exc:
            raise BadInput(f"{where}: coverage_exclude pattern {item['pattern']!r}: {exc}") from None
        out.append(CoverageExclusion(item["file"], item["pattern"], item["reason"]))
    return tuple(out)


def _vendor_fields(e: dict, where: str) -> tuple[None, str]:
    """A vendor fix (this pack's own) has no upstream pull request or commit, and no
    release contains it; its url (required) is the design reference."""
    for key in ("pr", "upstream_commit", "commit", "merge_commit"):
        if key in e:
            raise BadInput(f"{where}: a vendor fix has no {key} (no upstream change carries it)")
    if "url" not in e:
        raise BadInput(f"{where}: a vendor fix needs url (its design reference)")
    if str(e.get("fixed_in", "")).strip():
        raise BadInput(
            f"{where}: a vendor fix is in no release; fixed_in must be empty, not {e['fixed_in']!r}"
        )
    return None, ""


def _rule(r: object, where: str) -> FingerprintRule:
    if not isinstance(r, dict) or not isinstance(r.get("file"), str) or not isinstance(r.get("pattern"), str):
        raise BadInput(f"{where}: a fingerprint rule needs file and pattern strings")
    unknown = sorted(set(r) - RULE_KEYS)
    if unknown:
        raise BadInput(f"{where}: fingerprint rule with unknown key {unknown[0]!r}")
    if not isinstance(r.get("absent", False), bool):
        raise BadInput(f"{where}: fingerprint absent must be true or false")
    try:
        re.compile(r["pattern"])
    except re.error as err:
        raise BadInput(f"{where}: fingerprint pattern {r['pattern']!r}: {err}") from None
    return FingerprintRule(check_confined(r["file"], where), r["pattern"], bool(r.get("absent", False)))


def _check_dependencies(fixes: dict[str, Fix], path: Path) -> None:
    """Every dependency names a fix; none depends on itself, directly or through others."""
    for fix in fixes.values():
        for d in fix.depends_on:
            if d == fix.id:
                raise BadInput(f"{path} [{fix.id}]: depends on itself")
            if d not in fixes:
                raise BadInput(f"{path} [{fix.id}]: depends on {d!r}, which has no entry")
    done: set[str] = set()

    def visit(fid: str, trail: tuple[str, ...]) -> None:
        if fid in trail:
            cycle = " -> ".join(trail[trail.index(fid):] + (fid,))
            raise BadInput(f"{path}: dependency cycle {cycle}")
        if fid in done:
            return
        for d in fixes[fid].depends_on:
            visit(d, trail + (fid,))
        done.add(fid)

    for fid in fixes:
        visit(fid, ())


def load_variant(path: str | Path, fix_id: str | None = None, fix: Fix | None = None) -> PatchVariant:
    """One patch file. With ``fix`` (its fixes.toml entry) the header must agree with it."""
    path = Path(path)
    where = str(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadInput(f"{where}: cannot read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{where}: not UTF-8 text") from None
    if "\0" in text:
        raise BadInput(f"{where}: contains NUL bytes (binary?)")
    fields, body = parse_header(text, where)
    applies = parse_spec(fields["Applies-To"], where, "Applies-To")
    if not str(applies):
        raise BadInput(f"{where}: Applies-To is empty")
    try:
        last = _dt.date.fromisoformat(fields["Last-Update"].strip())
    except ValueError:
        raise BadInput(f"{where}: Last-Update {fields['Last-Update']!r} is not YYYY-MM-DD") from None
    deps = parse_ids(fields["Depends-On"], where, "Depends-On")
    if fix is not None:
        check_agreement(fields, deps, fix, where)
    ps, files = parse_diff(body, where)
    return PatchVariant(
        fix=fix_id or path.parent.name,
        path=path,
        sha256=hashlib.sha256(data).hexdigest(),
        header=MappingProxyType(fields),
        applies_to=applies,
        depends_on=deps,
        patchset=ps,
        files=files,
        last_update=last,
    )
