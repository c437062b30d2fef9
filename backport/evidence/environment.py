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


def interpreter_environment(python: str, packages: Iterable[str] = KEY_PACKAGES) -> dict:
    """Python, platform and package versions of an interpreter, read without importing the packages."""
    packages = list(packages)
    try:
        proc = subprocess.run([python, "-c", _ENV_SCRIPT, json.dumps(packages)],
                              check=False, capture_output=True, text=True, timeout=120)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {"python": None, "implementation": None, "platform": None, "machine": None,
                "packages": {name: None for name in packages}}


def probe_torch(probe_docs: dict[str, dict]) -> str | list[str] | None:
    """The torch the probes ran with: one version, the sorted versions when trees differ, or None."""
    torch = sorted({d["torch"] for d in probe_docs.values() if d.get("torch")})
    return torch[0] if len(torch) == 1 else (torch or None)


def environment_record(probe_env: dict, probe_docs: dict[str, dict]) -> dict:
    """The receipt's environment: the probe interpreter (where SGLang ran) and the toolkit's Python."""
    own = interpreter_environment(sys.executable, TOOLKIT_PACKAGES) if probe_env is not None else {}
    probe_env = probe_env or {}
    return {
        "python": probe_env.get("python"),
        "implementation": probe_env.get("implementation"),
        "platform": probe_env.get("platform"),
        "machine": probe_env.get("machine"),
        "torch": probe_torch(probe_docs),
        "packages": probe_env.get("packages", {}),
        "toolkit_python": own.get("python") or platform.python_version(),
        "toolkit_packages": own.get("packages", {}),
    }
