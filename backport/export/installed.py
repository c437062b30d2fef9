"""`status installed`: recognise an exported wheel in a running environment.

An exported wheel installs as `sglang X+backport.N`, its `sglang.__version__` says the same
(export/label.py), and it carries `sglang_backport.json` in its dist-info (export/wheel.py).
What the environment says is only a claim; the tree digest of the package as installed is
measured (with the version label taken back out), and a bundle matches only when its receipt's
subject `patched-tree/sglang` is that digest and the bundle itself verifies. A node is
`patched` only when all three agree: the record, the label `sglang.__version__` carries, and
the measured tree; a rolled-back node (upstream's wheel reinstalled) has none of them.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from backport.errors import BadInput
from backport.evidence.artifacts import PROVENANCE, TREE_SUBJECT
from backport.evidence.artifacts import tree_digest as subject_tree_digest
from backport.evidence.layout import RECEIPT
from backport.export.label import backport_label, installed_digest
from backport.tree import read_version

_READ = (
    "import json, importlib.metadata as m\n"
    "try:\n    d = m.distribution('sglang')\nexcept m.PackageNotFoundError:\n    d = None\n"
    f"print(json.dumps({{'version': d and d.version, 'provenance': d and d.read_text({PROVENANCE!r})}}))"
)


@dataclass(frozen=True)
class Installed:
    version: str | None            # the distribution's version, as `pip show sglang` prints it
    provenance: dict | None        # the exported wheel's record, None for an upstream wheel
    tree_digest: str               # measured on the installed package, the version label taken out
    bundles: tuple[dict, ...] = ()  # the given bundles whose subject is this tree, each verified
    package_version: str | None = None  # what `sglang.__version__` (and /server_info) says

    @property
    def is_backport(self) -> bool:
        return self.provenance is not None

    @property
    def digest_matches(self) -> bool | None:
        """The installed package against the tree digest its record claims (None: no record)."""
        return None if self.provenance is None else self.provenance.get("tree_digest") == self.tree_digest

    @property
    def patched(self) -> bool:
        """An exported build, whole: its record, the label sglang.__version__ says, the measured tree."""
        return bool(self.provenance and self.digest_matches and backport_label(self.package_version)
                    and self.package_version == self.provenance.get("version"))

    def to_json(self) -> dict:
        return {"version": self.version, "package_version": self.package_version, "patched": self.patched,
                "backport": self.provenance, "tree_digest": self.tree_digest,
                "digest_matches_record": self.digest_matches, "bundles": list(self.bundles)}


def read_distribution(python: str) -> tuple[str | None, dict | None]:
    try:
        proc = subprocess.run([python, "-c", _READ], capture_output=True, text=True, timeout=120, check=False)
    except OSError as exc:
        raise BadInput(f"installed: cannot run {python} ({exc.strerror})") from None
    if proc.returncode != 0:
        raise BadInput(f"installed: {python} cannot read the sglang distribution's metadata")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    record = found.get("provenance")
    try:
        provenance = json.loads(record) if record else None
    except ValueError:
        raise BadInput(f"installed: the sglang distribution's {PROVENANCE} is not JSON") from None
    return found.get("version"), provenance


def _bundles_under(path: Path) -> list[Path]:
    if (path / RECEIPT).is_file():
        return [path]
    if not path.is_dir():
        raise BadInput(f"--bundle {path}: neither an evidence bundle nor a folder of bundles")
    return sorted(p.parent for p in path.glob(f"*/{RECEIPT}"))


def matching_bundles(paths: list[Path], tree_digest: str) -> list[dict]:
    """Every bundle under `paths` whose receipt's subject is this tree, with whether it verifies."""
    from backport.evidence import verify

    found = []
    for bundle in (b for path in paths for b in _bundles_under(Path(path))):
        try:
            subjects = json.loads((bundle / RECEIPT).read_text())["subject"]
            digest = next((subject_tree_digest(s) for s in subjects if s.get("name") == TREE_SUBJECT), None)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if digest == tree_digest:
            result = verify(bundle)
            found.append({"bundle": str(bundle), "verifies": result.ok,
                          "problem": None if result.ok else str(result.first)})
    return found


def record_matches(record: dict | None, package_root: Path) -> bool:
    """Whether a package on disk is the patched tree an exported wheel's record names."""
    return record is not None and bool(record) and (
        record.get("tree_digest") == installed_digest(package_root, record.get("version")))


def describe_installed(python: str, package_root: Path, bundles: list[Path]) -> Installed:
    """`package_root` holds the environment's `sglang/` (or a snapshot of it)."""
    version, provenance = read_distribution(python)
    digest = installed_digest(package_root, (provenance or {}).get("version"))
    return Installed(version, provenance, digest, tuple(matching_bundles(bundles, digest)),
                     package_version=read_version(Path(package_root)))


COVERAGE_CHECK_FIX = "sbp-transfer-coverage"
COVERAGE_SWITCH = "SGLANG_DISAGGREGATION_TRANSFER_COVERAGE_CHECK=0"


def rollout(installed: Installed, present: set[str]) -> dict:
    """Which role this node's code expects to be upgraded in which order, whether its PD peer must run the
    pack too, and the rollback command (README, Rollout)."""
    upstream = (installed.version or "").split("+", 1)[0]
    if not installed.is_backport:
        return {
            "patched": False,
            "order": "not a wheel exported by sglang-backport: upgrade prefill nodes first, then decode",
            "peer_must_be_patched": None,
            "rollback": None,
        }
    checks = COVERAGE_CHECK_FIX in present
    return {
        "patched": True,
        "order": (
            "as prefill: safe with any decode, upgrade it first; as decode: upgrade it after every prefill "
            f"peer, or set {COVERAGE_SWITCH} on it while versions are mixed (a patched decode refuses an "
            "unpatched prefill's handoffs with HTTP 500); roll back decode first"
            if checks
            else "upgrade prefill first, then decode; roll back decode first"
        ),
        "peer_must_be_patched": True,
        "rollback": f"pip install --force-reinstall --no-deps 'sglang=={upstream}'" if upstream else None,
    }
