"""What else is open on a release: the advisories of `patches/advisories.toml`, judged per tree and
per deployment.

An advisory's affected releases are OSV-style ranges (events introduced / fixed / last_affected,
plus exceptions), compared with `packaging` versions. Where the code itself is at hand, the tree
check (`affected_when`, rules like a fix's fingerprint) decides instead: a patched tree keeps its
release's version but not always its code. Whether an affected deployment is exposed is the
advisory's condition (a server argument, prefill's bootstrap listener, the release itself), read
from the server's own `/server_info` or from the launch flags the operator gives.

One row per advisory, one of four statuses:
  fixed-by-pack   the pack's class for it is in the tree (its fixes' fingerprints all match)
  open            affected, and the condition is seen (or is the release itself)
  exposed-if      affected code, but no deployment was read: open when the condition holds
  not-applicable  the release or tree lacks the affected code, or the condition does not hold
(`unknown` where the condition's field is not reported.) Rows are information: the audit's exit
code and a run's verdict do not depend on them (docs/decisions.md).
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from backport.errors import BadInput

FILE = "advisories.toml"
FIXED_BY_PACK, OPEN, EXPOSED_IF, NOT_APPLICABLE, UNKNOWN = (
    "fixed-by-pack", "open", "exposed-if", "not-applicable", "unknown")
PACK_WORDS = {"none": "not carried by the pack", "planned": "open; pack fix planned"}
_CLASS_ID = re.compile(r"^SBP-\d{4}-\d{4}$")
_EVENTS = ("introduced", "fixed", "last_affected")
# prefill runs the bootstrap server for these backends (utils.get_kv_class: BOOTSTRAP_SERVER)
BOOTSTRAP_BACKENDS = ("mooncake", "nixl", "mori", "ascend")
# the server arguments a condition reads (a /server_info document carries them all)
SETTINGS = ("host", "disaggregation_mode", "disaggregation_transfer_backend", "disaggregation_bootstrap_port",
            "enable_custom_logit_processor", "admin_api_key", "enable_pd_role_switch")


@dataclass(frozen=True)
class Rule:
    file: str        # relative to the package root; may be a glob (any matching file)
    pattern: str     # Python regex, re.MULTILINE
    absent: bool = False

    def holds(self, root: Path) -> bool:
        files = sorted(root.glob(self.file)) if any(c in self.file for c in "*?[") else [root / self.file]
        found = any(re.search(self.pattern, f.read_text(errors="replace"), re.MULTILINE)
                    for f in files if f.is_file())
        return found != self.absent

    def describe(self) -> str:
        return f"{self.file}: {'no ' if self.absent else ''}/{self.pattern}/"


@dataclass(frozen=True)
class Part:
    name: str
    events: tuple[tuple[str, str], ...]          # (kind, version), in the file's order
    exceptions: tuple[tuple[str, bool, str], ...]  # (version, affected, reason)
    affected_when: tuple[Rule, ...]
    checked_on: tuple[str, ...]

    def in_range(self, version: str) -> bool:
        """The OSV rule: affected from an `introduced` up to the next `fixed` (excluded) or
        `last_affected` (included); an exception overrides it for its one version."""
        v = Version(version)
        for when, affected, _ in self.exceptions:
            if Version(when) == v:
                return affected
        affected = False
        for kind, at in sorted(self.events, key=lambda e: (Version(e[1]) if e[1] != "0" else Version("0"),
                                                             _EVENTS.index(e[0]))):
            bound = Version("0") if at == "0" else Version(at)
            if kind == "introduced" and v >= bound:
                affected = True
            elif (kind == "fixed" and v >= bound) or (kind == "last_affected" and v > bound):
                affected = False
        return affected

    def tree_affected(self, root: Path) -> bool:
        return all(rule.holds(root) for rule in self.affected_when)

    def range_text(self) -> str:
        text = ", ".join(f"{k} {'every release' if v == '0' else v}" for k, v in self.events)
        return text + "".join(f"; except {v} ({'affected' if a else 'not affected'}: {r})"
                              for v, a, r in self.exceptions)


@dataclass(frozen=True)
class Advisory:
    id: str
    aliases: tuple[str, ...]
    title: str
    references: tuple[str, ...]
    component: str
    pack: str                      # "none" | "planned" | a class id
    condition: Mapping
    parts: tuple[Part, ...]

    @property
    def pack_class(self) -> str | None:
        return self.pack if _CLASS_ID.fullmatch(self.pack) else None

    def pack_text(self) -> str:
        return f"the pack's class {self.pack}" if self.pack_class else PACK_WORDS[self.pack]


@dataclass(frozen=True)
class Row:
    advisory: str
    aliases: tuple[str, ...]
    title: str
    subject: str          # the tree role or the server URL the row is about
    status: str
    reason: str
    pack: str
    references: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        return {"advisory": self.advisory, "aliases": list(self.aliases), "title": self.title,
                "subject": self.subject, "status": self.status, "reason": self.reason, "pack": self.pack,
                "references": list(self.references)}


# ---- loading ---------------------------------------------------------------------------------


def _fail(path: Path, where: str, what: str) -> BadInput:
    return BadInput(f"{path}: {where}: {what}")


def _version(path: Path, where: str, text) -> str:
    try:
        if text != "0":
            Version(str(text))
    except InvalidVersion:
        raise _fail(path, where, f"{text!r} is not a version") from None
    return str(text)


def _part(path: Path, where: str, row: dict) -> Part:
    keys = {"name", "events", "exceptions", "affected_when", "checked_on"}
    if not isinstance(row, dict) or set(row) != keys:
        raise _fail(path, where, f"a part needs exactly the keys {', '.join(sorted(keys))}")
    events = []
    for event in row["events"]:
        if not isinstance(event, dict) or len(event) != 1 or next(iter(event)) not in _EVENTS:
            raise _fail(path, where, f"an event is one of {', '.join(_EVENTS)}: {event!r}")
        kind, at = next(iter(event.items()))
        events.append((kind, _version(path, where, at)))
    if not events or events[0][0] != "introduced":
        raise _fail(path, where, "events start with an introduced event")
    exceptions = []
    for item in row["exceptions"]:
        if not isinstance(item, dict) or set(item) != {"version", "affected", "reason"}:
            raise _fail(path, where, "an exception is { version, affected, reason }")
        exceptions.append(
            (_version(path, where, item["version"]), bool(item["affected"]), str(item["reason"]))
        )
    rules = []
    for rule in row["affected_when"]:
        if not isinstance(rule, dict) or not {"file", "pattern"} <= set(rule) <= {
            "file",
            "pattern",
            "absent",
        }:
            raise _fail(path, where, "a rule is { file, pattern[, absent] }")
        try:
            re.compile(rule["pattern"])
        except re.error as exc:
            raise _fail(path, where, f"pattern {rule['pattern']!r}: {exc}") from None
        rules.append(Rule(rule["file"], rule["pattern"], bool(rule.get("absent", False))))
    if not rules:
        raise _fail(path, where, "affected_when needs at least one rule (the tree check behind the range)")
    return Part(str(row["name"]), tuple(events), tuple(exceptions), tuple(rules),
                tuple(_version(path, where, v) for v in row["checked_on"]))


def load(series_dir: Path, class_ids: Iterable[str] | None = None) -> tuple[Advisory, ...]:
    """The advisories of `series_dir/advisories.toml`, checked (bad input names the entry); a
    `pack` class id must be one of `class_ids` when given (vulnerabilities.toml's)."""
    path = Path(series_dir) / FILE
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return ()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"{path}: cannot read ({exc})") from None
    if set(data) - {"advisory"}:
        raise BadInput(f"{path}: expected [[advisory]] tables only")
    keys = {"id", "aliases", "title", "references", "affects", "pack", "exposed_when", "part"}
    out = []
    for index, row in enumerate(data.get("advisory", [])):
        where = f"advisory #{index + 1}"
        if not isinstance(row, dict) or set(row) != keys:
            raise _fail(path, where, f"needs exactly the keys {', '.join(sorted(keys))}")
        where = f"advisory {row['id']}"
        pack = row["pack"]
        if pack not in PACK_WORDS and not (isinstance(pack, str) and _CLASS_ID.fullmatch(pack)):
            raise _fail(
                path, where, f"pack {pack!r}: one of {', '.join(PACK_WORDS)} or a class id SBP-YYYY-NNNN"
            )
        if class_ids is not None and _CLASS_ID.fullmatch(pack) and pack not in set(class_ids):
            raise _fail(path, where, f"pack {pack!r} is not a class of vulnerabilities.toml")
        cond = row["exposed_when"]
        if (
            not isinstance(cond, dict)
            or "why" not in cond
            or len(set(cond) & {"flag", "listener", "release"}) != 1
        ):
            raise _fail(path, where, "exposed_when is { flag | listener | release, why }")
        if cond.get("listener", "bootstrap") != "bootstrap" or (
            cond.get("flag") and cond["flag"] not in SETTINGS
        ):
            raise _fail(
                path, where, f"exposed_when: a flag among {', '.join(SETTINGS)}, listener 'bootstrap'"
            )
        if not row["references"] or not all(str(r).startswith("https://") for r in row["references"]):
            raise _fail(path, where, "references must be https URLs (at least one)")
        affects = row["affects"]
        if (
            not isinstance(affects, dict)
            or affects.get("package") != "sglang"
            or not affects.get("component")
        ):
            raise _fail(path, where, 'affects is { package = "sglang", component = "..." }')
        parts = tuple(_part(path, f"{where} part #{i + 1}", p) for i, p in enumerate(row["part"]))
        if not parts:
            raise _fail(path, where, "at least one [[advisory.part]]")
        out.append(Advisory(row["id"], tuple(row["aliases"]), row["title"], tuple(row["references"]),
                            affects["component"], pack, dict(cond), parts))
    return tuple(out)


# ---- conditions ------------------------------------------------------------------------------


def _is_set(value) -> bool:
    return value not in (None, False, "", 0, "None")


def _loopback(host) -> bool:
    if not isinstance(host, str):
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def condition(adv: Advisory, settings: Mapping | None) -> tuple[str, str]:
    """(open | not-applicable | unknown | exposed-if, reason) for an affected deployment whose server
    arguments are `settings` (None: no deployment was read)."""
    cond = adv.condition
    if "release" in cond:
        return OPEN, cond["why"]
    if settings is None:
        return EXPOSED_IF, f"exposed when: {cond['why']} (no server or launch flags given)"
    if "flag" in cond:
        name = cond["flag"]
        option = "--" + name.replace("_", "-")
        if name not in settings:
            return UNKNOWN, f"{name} not reported: whether {option} is set is not known"
        if _is_set(settings[name]):
            return OPEN, f"{option} set" if name != "admin_api_key" else cond["why"]
        return NOT_APPLICABLE, f"{option} not set"
    role = settings.get("disaggregation_mode")
    switch = _is_set(settings.get("enable_pd_role_switch"))
    if role is None and "disaggregation_mode" not in settings:
        return UNKNOWN, "disaggregation_mode not reported: whether a bootstrap server runs is not known"
    if role != "prefill" and not switch:
        return NOT_APPLICABLE, f"a {role if role == 'decode' else 'non-PD'} server runs no bootstrap server"
    backend = settings.get("disaggregation_transfer_backend")
    if isinstance(backend, str) and backend not in BOOTSTRAP_BACKENDS:
        return NOT_APPLICABLE, f"transfer backend {backend} has no bootstrap server"
    host, port = settings.get("host"), settings.get("disaggregation_bootstrap_port")
    where = f"{host}:{port}" if port is not None else str(host)
    if host is None:
        return UNKNOWN, "host not reported: where the bootstrap server binds is not known"
    if _loopback(host):
        return NOT_APPLICABLE, f"bootstrap server bound to loopback ({where})"
    return OPEN, f"bootstrap port bound beyond loopback ({where}), no token (no release has one)"


def settings_of(document: Mapping) -> dict:
    """The server arguments a condition reads, from a /server_info document (a key's value is
    kept as configured/not for the admin key: it is never carried further)."""
    out = {k: document[k] for k in SETTINGS if k in document}
    if "admin_api_key" in out:
        out["admin_api_key"] = _is_set(out["admin_api_key"])
    return out


# ---- rows ------------------------------------------------------------------------------------


def _affected_parts(adv: Advisory, version: str | None, root: Path | None) -> tuple[list[Part], str]:
    """(the parts affected, how that was decided): by the tree's code when a tree is given, else by
    the release's version against the ranges."""
    if root is not None:
        hit = [p for p in adv.parts if p.tree_affected(root)]
        return hit, "this tree's code"
    release = version or ""
    try:
        Version(release)
    except InvalidVersion:
        return [], ""
    return [p for p in adv.parts if p.in_range(release)], f"release {version}"


def row(adv: Advisory, subject: str, *, version: str | None, root: Path | None = None,
        settings: Mapping | None = None, pack_fixed: Callable[[str], bool] | None = None) -> Row:
    """One advisory's row for a tree (root) and/or a deployment (settings) of release `version`."""
    def make(status: str, reason: str) -> Row:
        return Row(adv.id, adv.aliases, adv.title, subject, status, reason, adv.pack_text(), adv.references)

    # "fixed by the pack" only on a release the advisory affects as shipped: a release that ships the
    # class's fixes itself (0.5.22 for #26789) has them too, and is judged on its code like any other
    shipped_affected = version is None or any(p.in_range(version) for p in adv.parts)
    if (adv.pack_class and root is not None and pack_fixed is not None and shipped_affected
            and pack_fixed(adv.pack_class)):
        return make(FIXED_BY_PACK, f"{adv.pack_class}'s fixes are in this tree")
    hit, how = _affected_parts(adv, version, root)
    if not how:
        return make(UNKNOWN, f"version {version!r} not known: give the tree (--python EXE or TREE)")
    if not hit:
        ranges = "; ".join(f"{p.name}: {p.range_text()}" for p in adv.parts)
        return make(NOT_APPLICABLE, f"{how} lacks the affected code ({ranges})")
    status, why = condition(adv, settings)
    names = "; ".join(p.name for p in hit)
    return make(status, f"{why} [{how} has: {names}]")


def tree_rows(advisories: Iterable[Advisory], subject: str, root: Path, version: str | None,
              pack_fixed: Callable[[str], bool] | None = None, settings: Mapping | None = None) -> list[Row]:
    return [row(a, subject, version=version, root=root, settings=settings, pack_fixed=pack_fixed)
            for a in advisories]


def pack_classes(series_dir: Path) -> dict[str, list[str]]:
    """{class id: its fixes} of the pack's vulnerabilities.toml; {} for a pack without one."""
    from backport.evidence.vulnerabilities import FILE as CLASSES
    from backport.evidence.vulnerabilities import load_classes

    if not (Path(series_dir) / CLASSES).is_file():
        return {}
    return {c.id: list(c.fixes) for c in load_classes(series_dir)}


def load_for(pack) -> tuple[Advisory, ...]:
    """The advisories of a loaded pack, their class links checked against its classes."""
    return load(pack.root, pack_classes(pack.root))


def class_fixed(pack, root: Path) -> Callable[[str], bool]:
    """pack_fixed for `row`: a class is in the tree when every fix it names is detected there."""
    from backport.engine import detect

    classes = pack_classes(pack.root)

    def fixed(class_id: str) -> bool:
        fixes = [f for f in classes.get(class_id, []) if f in pack.fixes]
        return bool(fixes) and all(d.present for d in detect(root, pack, fixes=fixes))

    return fixed


def bundle_section(pack, trees: Mapping[str, tuple[Path | None, str | None]]) -> dict | None:
    """predicate.advisories of a run's receipt: {role: [row, ...]} for each tree given as (package
    root, version); None when the pack knows no advisory. No deployment is read: an affected
    advisory whose condition is a server argument is `exposed-if`."""
    known = load_for(pack)
    if not known:
        return None
    return {role: [r.to_json() for r in tree_rows(known, role, root, version, class_fixed(pack, root))]
            for role, (root, version) in trees.items() if root is not None}


def render(section: Mapping[str, list[dict]] | None, roles: Iterable[str] = ()) -> list[str]:
    """REPORT.md's section from predicate.advisories (a pure function of the receipt), trees in the
    order of `roles` (the receipt's canonical JSON sorts its keys, so their order is not kept)."""
    if not section:
        return []
    order = [r for r in roles if r in section] + sorted(set(section) - set(roles))
    rows = [
        Row(r["advisory"], tuple(r["aliases"]), r["title"], r["subject"], r["status"], r["reason"], r["pack"])
        for role in order
        for r in section[role]
    ]
    return [
        "## What else is open on this release",
        "",
        (
            "Known advisories beyond this pack's classes (patches/advisories.toml), judged on each tree's "
            "code. "
            "No deployment was read: `exposed-if` is open when its condition holds (audit a deployment to "
            "see "
            "it). Information, not a verdict."
        ),
        "",
        *markdown(rows),
    ]


def markdown(rows: Iterable[Row]) -> list[str]:
    """The table, for REPORT.md and the audit's report."""
    out = ["| advisory | about | status | why | pack |", "|---|---|---|---|---|"]
    for r in rows:
        ident = r.advisory + (f" ({', '.join(r.aliases)})" if r.aliases else "")
        status = f"**{r.status}**" if r.status == OPEN else r.status
        out.append(
            f"| {ident}: {r.title} | {r.subject} | {status} | {r.reason.replace('|', '/')} | {r.pack} |"
        )
    return out
