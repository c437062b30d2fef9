"""What a run will do, decided before anything is fetched or built.

`plan(options)` checks every input (specs, the pack, the reference, the bundle directory) so that
bad input is refused in well under a second, before the probe environment (2.5 GB) is built or a
wheel downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from backport import evidence, resources
from backport.errors import BadInput
from backport.pack import Pack, load_pack
from backport.releases import WheelPin, default_path, load_pins
from backport.sources import parse_spec, source_kind
from backport.sources.local import pristine_checkout
from backport.tree import Tree

NONE_WORDS = ("none", "no", "off")


@dataclass(frozen=True)
class RunOptions:
    """The inputs of `sglang-backport run`, as a library call takes them."""

    spec: str
    out: Path | None = None
    reference: str | None = None       # a spec, "none", or None for the default
    head: str | None = None            # compare with this tree instead of applying the pack
    series: Path | None = None
    python: str | None = None
    allow_unpinned: bool = False
    upstream_base_url: str | None = None
    upstream_tests: bool = True
    keep_trees: bool = False
    bundle_root: Path | None = None  # where evidence/<target> goes without --out (default ./evidence)
    min_coverage: float | None = (
        None  # a floor for the patches' executed lines (percent); below it: a finding
    )
    export: bool = False               # put the patched wheel and the patch series in the bundle
    force: bool = False                # `out` may hold a bundle already: replace it (evidence/bundle.py)
    vuln_aliases: tuple[tuple[str, str], ...] = ()  # (class id or name, CVE/GHSA id): more VEX aliases
    live: bool = False                 # the live tier: a real PD deployment per tree (job/live.py)
    version: str | None = None         # --version: overrides a checkout's or git target's own version

    @property
    def replace_bundle(self) -> bool:
        """An existing bundle at the bundle directory may be replaced: the toolkit named the directory
        (evidence/<target>/, or <--out>/<target> with several SPECs), or --force."""
        return self.force or self.out is None


@dataclass(frozen=True)
class Plan:
    options: RunOptions
    series_dir: Path
    pack: Pack
    mode: str                          # "backport" | "upstream-pair"
    kind: str                          # the target spec's form: wheel | git | path | installed
    in_place: bool                     # the target is a user's git checkout (proved on a clone)
    reference_spec: str | None
    reference_choice: str
    matrix: Path                       # the release matrix in force (its pins fetch every spec)
    pins: dict[str, WheelPin]
    head_kind: str | None = None       # the --head spec's form
    checkout: Tree | None = None       # a user's checkout, described (at its recorded commit) when planned

    @property
    def total_steps(self) -> int:
        # environment, fetch, [clone, apply], [fetch-reference], probe, [upstream-tests], bundle
        return (2 + 2 * (self.mode == "backport") + (self.reference_spec is not None) + 1
                + self.options.upstream_tests + self.options.live + 1)


def default_reference(pack: Pack, pins: dict | None = None) -> str | None:
    """The first pinned release that every upstream fix's `fixed_in` contains (a vendor fix is
    in no release): the published floor every backport is judged against. Newer releases
    with every fix (0.5.23) are targets, not the reference."""
    pins = load_pins() if pins is None else pins
    fixes = [f for f in pack.fixes.values() if not f.is_vendor]
    if not fixes:
        return None
    versions = [v for v in pins if all(fix.is_fixed_in(v) for fix in fixes)]
    return f"sglang=={min(versions, key=Version)}" if versions else None


def is_user_checkout(spec: str) -> bool:
    path = Path(spec).expanduser()
    return path.is_dir() and (path / ".git").exists()


def plan(options: RunOptions) -> Plan:
    series_dir = Path(options.series) if options.series else resources.pack_dir()
    if not series_dir.is_dir():
        raise BadInput(f"{series_dir}: no such patch series directory")
    pack = load_pack(series_dir)
    matrix = default_path(series_dir)
    pins = load_pins(matrix)
    target = parse_spec(options.spec, allow_unpinned=options.allow_unpinned, python=options.python, pins=pins)
    head = (parse_spec(options.head, allow_unpinned=options.allow_unpinned, python=options.python, pins=pins)
            if options.head else None)
    reference = options.reference
    if reference and reference.lower() in NONE_WORDS:
        reference, choice = None, "none"
    elif reference:
        parse_spec(reference, allow_unpinned=options.allow_unpinned, pins=pins)
        choice = "given"
    else:
        reference = default_reference(pack, pins)
        choice = "default: the first pinned release whose version is in every fix's fixed_in"
    if options.out is not None:
        evidence.check_bundle_target(Path(options.out), replace=options.replace_bundle)
    if options.min_coverage is not None and not 0 <= options.min_coverage <= 100:
        raise BadInput(f"--min-coverage {options.min_coverage}: a percentage from 0 to 100")
    if options.export and (options.head or source_kind(target) != "wheel"):
        raise BadInput(f"--export: the patched wheel is built from a pinned upstream wheel, so it needs a "
                       f"sglang==X target and no --head ({options.spec} is a {source_kind(target)} target"
                       f"{' with --head' if options.head else ''})")
    if options.version is not None and source_kind(target) in ("wheel", "installed"):
        raise BadInput(f"--version {options.version}: only for a checkout, a directory or a git target "
                       f"({options.spec} says its own version)")
    in_place = is_user_checkout(options.spec)
    # A checkout is described now, before anything is built: its commit is what gets proved,
    # whatever happens to its work tree or HEAD while the run goes on.
    checkout = (
        pristine_checkout(Path(options.spec), options.spec, pack, options.version) if in_place else None
    )
    return Plan(options, series_dir, pack, "upstream-pair" if options.head else "backport",
                source_kind(target), in_place, reference, choice, matrix, pins,
                source_kind(head) if head is not None else None, checkout)


def bundle_dir(fetched_tree, kind: str, head: tuple | None = None, root: Path | None = None) -> Path:
    """<root>/<target>, root default ./evidence: sglang-0.5.19, git-<commit12>, path-<digest12>."""

    def name(tree, form: str) -> str:
        if form == "wheel":
            return f"sglang-{tree.version}"
        if form == "git":
            return f"git-{(tree.base_commit or tree.tree_digest)[:12]}"
        return f"{form}-{tree.version}-{tree.tree_digest[:12]}"

    base = name(fetched_tree, kind)
    return (root or Path.cwd() / "evidence") / (base if head is None else f"{base}..{name(*head)}")
