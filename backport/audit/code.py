"""The SGLang code an operator runs: found, fingerprinted, probed, read for its page-lifetime settings.

Two ways to name it: `--python EXE`, the interpreter of the serving environment (its `sglang`
package is found by asking that interpreter), or a TREE (a checkout or unpacked release).

Where the probes run: for a TREE, in the cached CPU probe environment. For `--python EXE`, in
that interpreter itself when it can import torch (the operator's own dependencies); otherwise
in the probe environment, with only that interpreter's `sglang` package on the path (through a
link, so its other site-packages cannot shadow the probe environment's torch).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from backport.engine import Detection, detect
from backport.errors import BadInput, Finding
from backport.pack import Pack
from backport.tree import read_version

ADMISSION_FIXES = ("pr36988", "pr38935")
ADMISSION_PROBES = ("admission", "prefill_retire")
PAGE_LIFETIME_FIXES = ("pr35049-inflight", "pr35049-ack", "pr35049-nixl", "pr35049", "pr37454", "pr40645",
                       "pr41023", "pr41402", "pr41404")
DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
CAPABILITY = "supports_deferred_decode_kv_release"
COVERAGE_FIX = "sbp-transfer-coverage"          # this pack's own transferred-coverage check
COVERAGE_ENV = "SGLANG_DISAGGREGATION_TRANSFER_COVERAGE_CHECK"
# Mooncake's legacy TCP completion ("complete" once bytes leave prefill's socket buffer): measured on the
# live tier's page-lifetime race, the drain ACK then comes before the writes land (patched 0.5.19 and
# upstream 0.5.22 both unsafe 3 of 3)
MOONCAKE_TCP_PROTO = "MC_TCP_PROTO"
_COVERAGE_DEFAULT = re.compile(r'get_bool_env_var\(\s*"' + COVERAGE_ENV + r'"\s*,\s*"(\w+)"\s*\)')
_ENV_DEFAULT = re.compile(r"^\s*(\w+)\s*=\s*Env(Bool|Float)\(\s*([^)]*?)\s*\)", re.MULTILINE)
_FALSE = ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Setting:
    """One environment-controlled setting: its value and where that value came from."""

    name: str
    value: bool | float | None
    source: str

    def to_json(self) -> dict:
        return {"name": self.name, "value": self.value, "source": self.source}


@dataclass(frozen=True)
class CodeFacts:
    how: str                               # "--python EXE" or "tree PATH"
    package_root: Path
    version: str | None
    detections: tuple[Detection, ...]
    probes: dict | None                    # the harness document, None when it could not run
    probe_error: str | None
    harness: str                           # which interpreter ran the probes, and why
    deferred_release: Setting
    timeout: Setting
    capable_backends: tuple[str, ...] | None   # None: this code has no capability flag
    has_checksum_flag: bool
    coverage_check: Setting | None = None      # None: this code has no coverage check
    extra: dict = field(default_factory=dict)

    def detection(self, fix: str) -> Detection | None:
        return next((d for d in self.detections if d.fix == fix), None)

    def to_json(self) -> dict:
        return {
            "how": self.how, "package_root": str(self.package_root), "version": self.version,
            "fixes": [d.to_json() for d in self.detections], "harness": self.harness,
            "probe_error": self.probe_error,
            "deferred_release": self.deferred_release.to_json(), "timeout": self.timeout.to_json(),
            "capable_backends": list(self.capable_backends) if self.capable_backends is not None else None,
            "has_disaggregation_enable_kv_checksum": self.has_checksum_flag,
            "coverage_check": self.coverage_check.to_json() if self.coverage_check else None,
            **self.extra,
        }


def package_root_of(python: str) -> Path:
    """The directory holding the `sglang` package that `python` imports (found, not imported)."""
    from backport.sources.local import installed_package

    return installed_package(python, f"--python {python}")


def exported_wheel(python: str, root: Path) -> dict:
    """{"exported_wheel": ...} when the environment's sglang is a wheel this toolkit exported (its
    record, and whether the package installed is the tree the record names), else {}."""
    from backport.export.installed import read_distribution, record_matches

    version, record = read_distribution(python)
    if record is None:
        return {}
    return {"exported_wheel": {"version": version, "spec": record.get("spec"),
                               "patch_set_sha256": record.get("patch_set_sha256"),
                               "tree_digest_matches": record_matches(record, root)}}


def can_import_torch(python: str) -> bool:
    proc = subprocess.run([python, "-c", "import torch"], capture_output=True, timeout=300, check=False)
    return proc.returncode == 0


def env_defaults(package_root: Path) -> dict[str, tuple[str, str]]:
    """{name: (kind, default text)} for every EnvBool/EnvFloat declared in sglang/srt/environ.py."""
    environ = package_root / "sglang" / "srt" / "environ.py"
    text = environ.read_text(errors="replace") if environ.is_file() else ""
    return {m.group(1): (m.group(2), m.group(3)) for m in _ENV_DEFAULT.finditer(text)}


def deferred_settings(package_root: Path, environ: dict[str, str]) -> tuple[Setting, Setting]:
    """Deferred release on/off and its timeout: the audit's environment when it sets them, else
    the code's declared default. The servers' own environment is not reported over HTTP."""
    declared = env_defaults(package_root)
    out = []
    for name, parse in ((DEFERRED_ENV, _parse_bool), (TIMEOUT_ENV, _parse_float)):
        if name in environ:
            out.append(Setting(name, parse(environ[name]), "set in the audit's environment"))
        elif name in declared:
            value = parse(declared[name][1])
            out.append(Setting(name, value, f"this code's default (sglang/srt/environ.py: "
                                            f"Env{declared[name][0]}({declared[name][1]}))"))
        else:
            out.append(Setting(name, None, "this code does not declare it (sglang/srt/environ.py)"))
    return out[0], out[1]


def coverage_setting(package_root: Path, environ: dict[str, str]) -> Setting | None:
    """This pack's coverage check on decode: None when the code has none; else on/off, from the
    audit's environment when set there, else the code's default."""
    utils = package_root / "sglang" / "srt" / "disaggregation" / "utils.py"
    match = _COVERAGE_DEFAULT.search(utils.read_text(errors="replace")) if utils.is_file() else None
    if match is None:
        return None
    if COVERAGE_ENV in environ:
        return Setting(COVERAGE_ENV, _parse_bool(environ[COVERAGE_ENV]), "set in the audit's environment")
    return Setting(COVERAGE_ENV, _parse_bool(match.group(1)),
                   f"this code's default (disaggregation/utils.py: {match.group(1)!r})")


def _parse_bool(text: str) -> bool | None:
    text = text.strip().strip("'\"").lower()
    if text in ("1", "true", "yes", "on"):
        return True
    return False if text in _FALSE else None


def _parse_float(text: str) -> float | None:
    try:
        return float(text.strip().strip("'\""))
    except ValueError:
        return None


def capable_backends(package_root: Path) -> tuple[str, ...] | None:
    """Transfer backends whose KV manager opts in to deferred release (the class attribute
    `supports_deferred_decode_kv_release = True`, inherited through the managers' bases, as
    Ascend inherits Mooncake's). None when this code has no such attribute at all."""
    disagg = package_root / "sglang" / "srt" / "disaggregation"
    classes: dict[str, tuple[list[str], bool | None]] = {}
    defined_in: dict[str, list[str]] = {}
    mentioned = False
    for conn in sorted(disagg.glob("*/conn.py")):
        try:
            module = ast.parse(conn.read_text(errors="replace"))
        except SyntaxError:
            continue
        for node in module.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            own = None
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else (
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) and stmt.value is not None else [])
                if any(isinstance(t, ast.Name) and t.id == CAPABILITY for t in targets):
                    mentioned = True
                    own = (isinstance(stmt, (ast.Assign, ast.AnnAssign))
                           and isinstance(stmt.value, ast.Constant) and stmt.value.value is True)
            classes[node.name] = (bases, own)
            if node.name.endswith("KVManager"):
                defined_in.setdefault(conn.parent.name, []).append(node.name)
    if not mentioned:
        return None

    def resolve(name: str, seen: frozenset = frozenset()) -> bool:
        bases, own = classes.get(name, ([], None))
        if own is not None:
            return own
        return any(resolve(b, seen | {name}) for b in bases if b in classes and b not in seen)

    return tuple(sorted(backend for backend, managers in defined_in.items()
                        if any(resolve(m) for m in managers)))


def has_checksum_flag(package_root: Path) -> bool:
    """True when this code's server arguments declare --disaggregation-enable-kv-checksum."""
    srt = package_root / "sglang" / "srt"
    candidates = [srt / "server_args.py", *sorted((srt / "arg_groups").rglob("*.py"))]
    return any("disaggregation_enable_kv_checksum" in p.read_text(errors="replace")
               for p in candidates if p.is_file())


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _run_probes(harness_python: str, package_root: Path, label: str, version: str | None):
    from backport.probing import run_harness

    try:  # the version decided here, never the probes' reading of sglang.version's fallback
        return run_harness(harness_python, package_root, list(ADMISSION_PROBES), label=label,
                           version=version), None
    except (Finding, BadInput) as exc:  # the harness crashed or refused: the gate stays unknown
        return None, str(exc)


def inspect_code(pack: Pack, *, tree: str | None = None, python: str | None = None,
                 environ: dict[str, str] | None = None, probe_python: str | None = None) -> CodeFacts:
    """Everything the gates need to know about the code, probes included (~10 s)."""
    from backport.probing import ensure_env

    environ = dict(os.environ if environ is None else environ)
    if (tree is None) == (python is None):
        raise BadInput("audit: give either --python EXE or a TREE, not both")
    version: str | None  # a tree knows its release; an interpreter's package may not say
    if tree is not None:
        from backport.tree import open_tree

        opened = open_tree(Path(tree))
        root, version, how = opened.package_root, opened.version, f"tree {opened.path}"
        harness_python = str(ensure_env(probe_python))
        harness = f"the CPU probe environment ({harness_python}) with the tree on the path"
        link_dir, extra = None, {}
    else:
        assert python is not None  # checked above: exactly one of tree and python
        root = package_root_of(python)
        version, how = read_version(root), f"--python {python}"
        extra = exported_wheel(python, root)
        if extra:
            wheel = extra["exported_wheel"]
            how += (f" (sglang {wheel['version']}, a wheel exported by sglang-backport; its package "
                    + ("is" if wheel["tree_digest_matches"] else "is NOT") + " the tree its record names)")
        link_dir = None
        if can_import_torch(python):
            harness_python = python
            harness = f"the operator's interpreter {python} (it imports torch)"
        else:
            harness_python = str(ensure_env(probe_python))
            harness = (f"the CPU probe environment ({harness_python}) with a copy of {root}/sglang "
                       f"alone on the path ({python} cannot import torch)")
            # A copy (hard links where the file system allows), not the site-packages itself:
            # its other packages must not shadow the probe environment's. Not a symlink either:
            # the harness checks that the sglang it imports really lives under the tree it names.
            link_dir = tempfile.TemporaryDirectory(prefix="sglang-backport-audit-")
            shutil.copytree(root / "sglang", Path(link_dir.name) / "sglang", copy_function=_link_or_copy,
                            ignore=shutil.ignore_patterns("__pycache__"))
    try:
        detections = detect(root, pack, version=version if version and version != "unknown" else None,
                            fixes=[f for f in (*ADMISSION_FIXES, *PAGE_LIFETIME_FIXES, COVERAGE_FIX)
                                   if f in pack.fixes])
        probe_root = Path(link_dir.name) if link_dir else root
        probes, probe_error = _run_probes(harness_python, probe_root, label=how, version=version)
    finally:
        if link_dir is not None:
            link_dir.cleanup()
    deferred, timeout = deferred_settings(root, environ)
    if MOONCAKE_TCP_PROTO in environ:
        extra["mooncake_tcp_proto"] = environ[MOONCAKE_TCP_PROTO].strip()
    return CodeFacts(how=how, package_root=root, version=None if version == "unknown" else version,
                     detections=detections, probes=probes, probe_error=probe_error, harness=harness,
                     deferred_release=deferred, timeout=timeout,
                     capable_backends=capable_backends(root), has_checksum_flag=has_checksum_flag(root),
                     coverage_check=coverage_setting(root, environ), extra=extra)
