"""A materialised SGLang tree: a git work tree whose package root holds `sglang/`.

Wheel and snapshot trees keep `sglang/` at the repository root; an upstream checkout
keeps it under `python/`. Patches name paths relative to the package root, so the
same patch serves both (the prefix is added when applying).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import git
from packaging.version import InvalidVersion, Version

from backport.digests import sha256_bytes, sha256_file
from backport.errors import BadInput

PACKAGE_PREFIXES = ("", "python/")

# Fixed identity and date for commits the toolkit makes, so that the same inputs give
# the same commit ids on every machine (receipts compare them).
TOOL_ACTOR = git.Actor("sglang-backport", "sglang-backport@localhost")
PRISTINE_DATE = "2000-01-01T00:00:00+00:00"


@dataclass(frozen=True)
class Tree:
    path: Path                 # git work tree root
    package_prefix: str        # "" or "python/": where `sglang/` lives inside `path`
    version: str
    spec: str
    artifact_sha256: str | None
    tree_digest: str
    base_commit: str | None    # the pristine upstream commit
    unpinned: bool = False

    @property
    def package_root(self) -> Path:
        return self.path / self.package_prefix if self.package_prefix else self.path

    def to_json(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        data["tree"] = str(self.path)
        data["package_root"] = str(self.package_root)
        return data

    @classmethod
    def from_json(cls, data: dict) -> Tree:
        return cls(
            path=Path(data["path"]),
            package_prefix=data["package_prefix"],
            version=data["version"],
            spec=data["spec"],
            artifact_sha256=data.get("artifact_sha256"),
            tree_digest=data["tree_digest"],
            base_commit=data.get("base_commit"),
            unpinned=bool(data.get("unpinned", False)),
        )


def find_package_prefix(root: Path) -> str | None:
    for prefix in PACKAGE_PREFIXES:
        if (root / prefix / "sglang" / "__init__.py").is_file():
            return prefix
    return None


def package_root_of(path: str | Path) -> Path:
    """The directory holding `sglang/` of a tree: the path itself (a wheel or snapshot tree) or
    its `python/` (an upstream checkout). Bad input when there is none."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise BadInput(f"{path}: not a directory")
    prefix = find_package_prefix(path)
    if prefix is None:
        raise BadInput(f"{path}: not an SGLang tree (no sglang/__init__.py or python/sglang/__init__.py)")
    return path / prefix if prefix else path


def is_package_source(name: str) -> bool:
    """Whether a path of the package (`sglang/...`, on disk or in a wheel) is its source: importing
    a tree writes `__pycache__/` and `.pyc` files, which are not, and no digest counts them."""
    return "__pycache__" not in name.split("/") and not name.endswith(".pyc")


def manifest_files(package_root: Path):
    """(path, literal bytes or None to read the file) for every source file of `sglang/`: a symbolic
    link counts by its target."""
    top = package_root / "sglang"
    for path in sorted(top.rglob("*")):
        if not is_package_source(path.as_posix()):
            continue
        if path.is_symlink():
            yield path, ("symlink:" + str(path.readlink())).encode()
        elif path.is_file():
            yield path, None


def manifest_text(entries) -> str:
    """`sha256sum` lines for (path relative to the package root, sha256) pairs, sorted by path."""
    return "".join(f"{digest}  {name}\n" for name, digest in sorted(entries))


def manifest_digest(entries) -> str:
    """The tree digest of (path, sha256) pairs: a tree on disk, or a wheel's `sglang/` members."""
    return hashlib.sha256(manifest_text(entries).encode()).hexdigest()


def tree_manifest(package_root: Path) -> str:
    """`sha256sum` lines for every file of the `sglang/` package, sorted by path."""
    return manifest_text(
        (
            path.relative_to(package_root).as_posix(),
            sha256_bytes(literal) if literal is not None else sha256_file(path),
        )
        for path, literal in manifest_files(package_root)
    )


def tree_digest(package_root: Path) -> str:
    """sha256 of the tree manifest: one digest that changes with any byte of the package."""
    return hashlib.sha256(tree_manifest(package_root).encode()).hexdigest()


_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.MULTILINE)


def read_version(package_root: Path) -> str | None:
    """The release version the package says it is (`_version.py` in wheels, `version.py` before)."""
    for name in ("_version.py", "version.py"):
        candidate = package_root / "sglang" / name
        if candidate.is_file():
            match = _VERSION_RE.search(candidate.read_text(errors="replace"))
            if match:
                return match.group(1)
    return None


def describe_tag(repo: git.Repo) -> tuple[str, int] | None:
    """(the nearest release tag's version, commits since it) from `git describe`, or None untagged
    (or when the nearest `v...` tag is no PEP 440 version)."""
    try:
        described = repo.git.describe("--tags", "--long", "--match", "v[0-9]*")
    except git.GitCommandError:
        return None
    match = re.fullmatch(r"v(.+)-(\d+)-g[0-9a-f]+", described.strip())
    try:
        return (str(Version(match.group(1))), int(match.group(2))) if match else None
    except InvalidVersion:
        return None


def tag_version(version: str, distance: int) -> str:
    """`v0.5.20` plus 123 commits is `0.5.20.post0.dev123` (`v0.5.4.post1`: `0.5.4.post2.dev123`):
    after the tag, before the next release, which is what variant selection needs."""
    if distance == 0:
        return version
    tagged = Version(version)
    return f"{tagged.base_version}.post{0 if tagged.post is None else tagged.post + 1}.dev{distance}"


def _file_agrees(said: str, tag: str, distance: int) -> bool:
    """Whether a version file's `said` fits the tag: at the tag, the same public version; past it,
    no earlier release (a generated `X.dev N+g<hash>` guesses the next one)."""
    try:
        file_version, tag_version = Version(said), Version(tag)
    except InvalidVersion:
        return False
    if distance == 0:
        return file_version.public == tag_version.public
    return file_version.release >= tag_version.release


def checkout_version(repo: git.Repo, package_root: Path) -> str | None:
    """The version of a git checkout, from the truth: its release tag. A version file
    (`_version.py`, generated by `pip install -e` and git-ignored, or `version.py`) that says
    another release is refused with both named: a stale one made a v0.5.19 checkout 0.5.13."""
    said, tag = read_version(package_root), describe_tag(repo)
    if tag is None:
        return said
    if said is not None and not _file_agrees(said, *tag):
        where = next(n for n in ("_version.py", "version.py") if (package_root / "sglang" / n).is_file())
        raise BadInput(
            f"{package_root / 'sglang' / where}: says {said} but the checkout's release tag says "
            f"v{tag[0]}{f' (+{tag[1]} commits)' if tag[1] else ''}; remove or regenerate the stale "
            f"file, or pass --version X (run, apply, status)"
        )
    return tag_version(*tag)


def no_version_message(tree: Tree, kind: str) -> str:
    """Why a tree has no version, and the way out (variant selection needs one). `kind`: checkout
    (a user's, in place), git (a git+URL@SHA target) or path (a directory)."""
    if kind == "checkout":
        return (
            f"{tree.path}: no version: no release tag (v0.5.19 ...) is reachable from HEAD and there is no "
            f"sglang/_version.py; fetch the tags (git -C {tree.path} fetch --tags) or pass --version X"
        )
    if kind == "git":
        return (
            f"{tree.spec}: no version: no release tag (v0.5.19 ...) in that repository is reachable from the "
            f"commit; pass --version X"
        )
    return f"{tree.spec}: no version: sglang/_version.py and sglang/version.py name none; pass --version X"


def decided_version(tree: Tree, override: str | None, kind: str) -> str:
    """The version the toolkit works with: `--version` when given (a PEP 440 version), else the
    tree's; BadInput when there is none."""
    if override is not None:
        try:
            return str(Version(override))
        except InvalidVersion:
            raise BadInput(f"--version {override}: not a PEP 440 version") from None
    if tree.version == "unknown":
        raise BadInput(no_version_message(tree, kind))
    return tree.version


def open_tree(path: Path, *, spec: str | None = None, version: str | None = None) -> Tree:
    """Describe an existing directory as a Tree without modifying it. `version` (`--version`)
    overrides what the tree says; a checkout's tag and version file must agree otherwise."""
    path = path.expanduser().resolve()
    package_root = package_root_of(path)
    prefix = find_package_prefix(path)
    assert prefix is not None  # package_root_of refused a directory without one
    base_commit = None
    said = version
    try:
        repo = git.Repo(path)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        repo = None
    if repo is not None:
        with repo:
            if (
                repo.working_tree_dir
                and Path(repo.working_tree_dir).resolve() == path
                and repo.head.is_valid()
            ):
                base_commit = _pristine_commit(repo)
                said = said or checkout_version(repo, package_root)
            else:
                said = said or read_version(package_root)
    else:
        said = said or read_version(package_root)
    return Tree(
        path=path,
        package_prefix=prefix,
        version=said or "unknown",
        spec=spec or str(path),
        artifact_sha256=None,
        tree_digest=tree_digest(package_root),
        base_commit=base_commit,
    )


def clone_tree(source: Tree, parent: Path, dest: Path | None = None) -> Tree:
    """A fresh git clone of `source` (at `dest`, or a new directory under `parent`), described as a Tree."""
    import tempfile

    from backport.gitops import clone_work_tree

    if dest is None:
        parent.mkdir(parents=True, exist_ok=True)
        dest = Path(tempfile.mkdtemp(prefix=f"sglang-{source.version}-", dir=parent))
    dest = Path(dest).absolute()  # git runs in dest's parent: a relative dest would nest (trees/trees/x)
    clone_work_tree(source.path, dest)
    return Tree(dest.resolve(), source.package_prefix, source.version, source.spec, source.artifact_sha256,
                source.tree_digest, source.base_commit, source.unpinned)


def clone_commit(source: Tree, commit: str, parent: Path) -> Tree:
    """A fresh clone of `source`'s repository checked out at `commit`, its digest taken from the
    clone: what a checkout's commit holds, whatever its work tree or HEAD does meanwhile."""
    clone = clone_tree(source, parent)
    try:
        with git.Repo(clone.path) as repo:
            repo.git.checkout("-q", "--detach", commit)
    except git.GitCommandError:
        import shutil

        shutil.rmtree(clone.path, ignore_errors=True)
        raise BadInput(
            f"{source.path}: commit {commit[:12]} is no longer reachable from its branches"
        ) from None
    return Tree(clone.path, source.package_prefix, source.version, source.spec, source.artifact_sha256,
                tree_digest(clone.package_root), commit, source.unpinned)


def _pristine_commit(repo: git.Repo) -> str:
    """The first commit that is not the toolkit's own backport commit."""
    for commit in repo.iter_commits("HEAD"):
        if "Backport-Of:" not in commit.message and "Vendor-Fix:" not in commit.message:
            return commit.hexsha
    return repo.head.commit.hexsha


def commit_all(repo: git.Repo, message: str, date: str = PRISTINE_DATE) -> str:
    """Commit everything in the work tree as the toolkit, at a fixed date (reproducible ids)."""
    repo.git.add("-A", "--force")
    env = {
        "GIT_AUTHOR_NAME": TOOL_ACTOR.name, "GIT_AUTHOR_EMAIL": TOOL_ACTOR.email,
        "GIT_COMMITTER_NAME": TOOL_ACTOR.name, "GIT_COMMITTER_EMAIL": TOOL_ACTOR.email,
        "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date,
    }
    with repo.git.custom_environment(**env):
        repo.git.commit("--no-verify", "--allow-empty", "--no-gpg-sign", "-q", "-m", message)
    return repo.head.commit.hexsha
