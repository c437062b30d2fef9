"""What the results depend on besides the trees: the probe interpreter and the toolkit itself."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from backport import __version__, resources
from backport.digests import sha256_file

# Packages whose versions decide how SGLang's modules behave on a CPU (probes/requirements-cpu.txt).
KEY_PACKAGES = ("torch", "transformers", "tokenizers", "triton", "numpy", "xgrammar", "apache-tvm-ffi",
                "compressed-tensors", "pydantic", "pytest")
TOOLKIT_PACKAGES = ("gitpython", "unidiff", "packaging", "requests")


def directory_digest(root: Path) -> str:
    """sha256 of the `sha256sum` manifest of every file under `root` (`__pycache__` excluded), as a tree
    digest."""
    from backport.tree import manifest_digest

    return manifest_digest((path.relative_to(root).as_posix(), sha256_file(path))
                           for path in sorted(Path(root).rglob("*"))
                           if path.is_file() and "__pycache__" not in path.relative_to(root).parts)


def code_digests() -> dict:
    """The code that judged: the toolkit's package, the probes package, the probe environment's
    requirements."""
    return {"backport_sha256": directory_digest(Path(__file__).resolve().parent.parent),
            "probes_sha256": directory_digest(resources.probes_dir()),
            "probe_requirements_sha256": sha256_file(resources.probes_dir() / "requirements-cpu.txt")}


def distribution_info() -> dict:
    """How this toolkit was installed (PEP 610's direct_url.json): from a source checkout, a directory,
    or a wheel file, whose sha256 is recorded when the installer recorded it or the file is still there."""
    if resources.checkout_root() is not None:
        return {"installed_from": "source checkout", "wheel": None, "wheel_sha256": None}
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    try:
        raw = metadata.distribution("sglang-backport").read_text("direct_url.json")
        direct = json.loads(raw) if raw else None
    except (metadata.PackageNotFoundError, ValueError):
        direct = None
    if not isinstance(direct, dict):
        return {"installed_from": "package index or unknown", "wheel": None, "wheel_sha256": None}
    url = str(direct.get("url", ""))
    if "dir_info" in direct:
        editable = bool((direct.get("dir_info") or {}).get("editable"))
        return {"installed_from": "editable directory" if editable else "directory", "wheel": None,
                "wheel_sha256": None}
    name = unquote(urlparse(url).path).rsplit("/", 1)[-1] or None
    hashes = (direct.get("archive_info") or {}).get("hashes") or {}
    digest = hashes.get("sha256")
    if digest is None and url.startswith("file://"):
        path = Path(unquote(urlparse(url).path))
        digest = sha256_file(path) if path.is_file() else None
    return {"installed_from": "wheel" if name and name.endswith(".whl") else "archive", "wheel": name,
            "wheel_sha256": digest}


@dataclass(frozen=True)
class Toolkit:
    """The toolkit that judged (the receipt's predicate.toolkit): version, git commit of the checkout
    (None outside one) and whether its deciding code was dirty, the digests of that code, how it was
    installed."""

    version: str
    git_commit: str | None
    git_dirty: bool | None
    code: dict[str, str]
    distribution: dict[str, str | None]
    name: str = "sglang-backport"

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version, "git_commit": self.git_commit,
                "git_dirty": self.git_dirty, "code": dict(self.code), "distribution": dict(self.distribution)}

    @classmethod
    def from_json(cls, doc: dict) -> Toolkit:
        """A receipt's predicate.toolkit read back (format 1 and 2 receipts have no code or distribution)."""
        return cls(version=doc["version"], git_commit=doc.get("git_commit"), git_dirty=doc.get("git_dirty"),
                   code=dict(doc.get("code") or {}), distribution=dict(doc.get("distribution") or {}),
                   name=doc.get("name", "sglang-backport"))


def toolkit_info(root: Path | None = None) -> Toolkit:
    """Version and git commit of the toolkit checkout (commit null when it is not a git checkout), the
    digests of the code that judged, and how the toolkit was installed."""
    root = Path(root or resources.SOURCE_ROOT)
    commit = None
    dirty = None
    try:
        import git

        repo = git.Repo(root)
        try:
            if (repo.head.is_valid() and repo.working_tree_dir
                    and Path(repo.working_tree_dir).resolve() == root.resolve()):
                commit = repo.head.commit.hexsha
                # Only the code that decides results; bundles written under evidence/ do not count.
                status = repo.git.status("--porcelain", "--untracked-files=no", "--",
                                         "backport", "probes", "patches", "pyproject.toml")
                dirty = bool(status.strip())
        finally:
            repo.close()
    except Exception:  # noqa: BLE001 - not a checkout, or no git: recorded as null
        commit, dirty = None, None
    return Toolkit(version=__version__, git_commit=commit, git_dirty=dirty, code=code_digests(),
                   distribution=distribution_info())


_ENV_SCRIPT = r"""
import json, platform, sys
from importlib import metadata
names = json.loads(sys.argv[1])
packages = {}
for name in names:
    try:
        packages[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        packages[name] = None
print(json.dumps({"python": platform.python_version(), "implementation": platform.python_implementation(),
                  "platform": platform.platform(), "machine": platform.machine(), "packages": packages}))
"""


@dataclass(frozen=True)
class Interpreter:
    """One interpreter as `_ENV_SCRIPT` reports it (None where it could not be read)."""

    python: str | None
    implementation: str | None
    platform: str | None
    machine: str | None
    packages: dict[str, str | None]

    @classmethod
    def from_json(cls, doc: dict) -> Interpreter:
        return cls(python=doc.get("python"), implementation=doc.get("implementation"),
                   platform=doc.get("platform"), machine=doc.get("machine"),
                   packages=dict(doc.get("packages") or {}))


def interpreter_environment(python: str, packages: Iterable[str] = KEY_PACKAGES) -> Interpreter:
    """Python, platform and package versions of an interpreter, read without importing the packages."""
    packages = list(packages)
    try:
        proc = subprocess.run([python, "-c", _ENV_SCRIPT, json.dumps(packages)],
                              check=False, capture_output=True, text=True, timeout=120)
        return Interpreter.from_json(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, AttributeError):
        return Interpreter(None, None, None, None, {name: None for name in packages})


def probe_torch(probe_docs: dict[str, dict]) -> str | list[str] | None:
    """The torch the probes ran with: one version, the sorted versions when trees differ, or None."""
    torch = sorted({d["torch"] for d in probe_docs.values() if d.get("torch")})
    return torch[0] if len(torch) == 1 else (torch or None)


@dataclass(frozen=True)
class Environment:
    """The receipt's predicate.environment: the probe interpreter (where SGLang ran) and the toolkit's
    Python. The torch the probes ran with is not here: the statement takes it from the probe documents
    (`probe_torch`), where `verify` checks it."""

    probe: Interpreter
    toolkit_python: str
    toolkit_packages: dict[str, str | None]

    def to_json(self, torch: str | list[str] | None) -> dict:
        return {"python": self.probe.python, "implementation": self.probe.implementation,
                "platform": self.probe.platform, "machine": self.probe.machine, "torch": torch,
                "packages": dict(self.probe.packages), "toolkit_python": self.toolkit_python,
                "toolkit_packages": dict(self.toolkit_packages)}

    @classmethod
    def from_json(cls, doc: dict) -> Environment:
        """A receipt's predicate.environment read back (its torch is the probe documents')."""
        return cls(probe=Interpreter.from_json(doc), toolkit_python=doc.get("toolkit_python") or "",
                   toolkit_packages=dict(doc.get("toolkit_packages") or {}))


def environment_record(probe_env: Interpreter) -> Environment:
    """The receipt's environment: the probe interpreter and the toolkit's own Python."""
    own = interpreter_environment(sys.executable, TOOLKIT_PACKAGES)
    return Environment(probe=probe_env, toolkit_python=own.python or platform.python_version(),
                       toolkit_packages=own.packages)
