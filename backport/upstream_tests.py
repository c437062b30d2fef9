"""Upstream SGLang's own CPU unit tests, run against trees as differential evidence.

The tests the SGLang maintainers wrote for a fix live in the repository's `test/` tree,
which no wheel ships and this project never commits. They are obtained at run time, at
the revision `patches/fixes.toml` names for each fix:

- from a tree that is a full upstream git checkout holding that revision (its own
  `test/` file at that commit, no network), otherwise
- downloaded from `{base_url}/{rev}/{path}` (GitHub's raw-file address by default, a
  mirror through `--base-url` or `SGLANG_BACKPORT_UPSTREAM_URL`).

Every file is cached under `<cache>/upstream-tests/<rev>/<path>` with a `.sha256`
sidecar. Content at a fixed revision must never change: a later copy whose sha256
differs from the recorded one is refused. When the base URL cannot be reached, a cached
copy is used; without one the file is not run and the result says why (never a pass).

Each file runs in its own pytest process in the probe interpreter, copied into a
temporary directory, with the tree as the only SGLang on the path (as upstream's CI runs
one process per file). Outcomes come from pytest's JUnit XML. An error caused by a name
the tree does not have at all (an import or attribute from code newer than the tree,
unrelated to the fixes) is `incompatible` and names the missing name; a missing name that
the series' own patches add means the tree lacks the fix, and counts as `failed`.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path, PurePosixPath

import git
import requests

from backport import cache
from backport.errors import BadInput
from backport.probing import probe_environ

DEFAULT_BASE_URL = "https://raw.githubusercontent.com/sgl-project/sglang"
BASE_URL_ENV = "SGLANG_BACKPORT_UPSTREAM_URL"
DEFAULT_SERIES = Path(__file__).resolve().parent.parent / "patches"

OUTCOMES = ("passed", "failed", "error", "skipped", "incompatible")
CONNECT_TIMEOUT = 10.0           # seconds to reach the server
READ_TIMEOUT = 60.0              # seconds between bytes
MAX_FILE_BYTES = 4 * 1024 * 1024  # a unit test file is tens of KB
PYTEST_TIMEOUT = 1800.0          # seconds for one file on one tree
REASON_LIMIT = 400

_REV_RE = re.compile(r"[0-9a-fA-F]{7,40}")


@dataclass(frozen=True)
class TestRef:
    """One upstream test file at one revision (`patches/fixes.toml`, `upstream_tests`)."""

    __test__ = False  # not a pytest test class

    path: str                       # repository-relative, e.g. test/registered/unit/.../test_x.py
    rev: str                        # the upstream commit to take it from
    fix: str | None = field(default=None, compare=False)
    # Names the series' patches add (functions, classes, attributes, modules): a tree that
    # lacks one of these lacks a fix, which is a failure, not an incompatibility.
    fix_names: frozenset[str] = field(default=frozenset(), compare=False)


# ---- reading the pack -----------------------------------------------------------------------


def _fix_tables(document: dict) -> dict[str, dict]:
    """Fix id -> its table, for `[[fix]]` arrays (with `id`) or tables keyed by fix id."""
    found: dict[str, dict] = {}
    for key, value in document.items():
        if isinstance(value, list) and all(isinstance(v, dict) for v in value):
            for table in value:
                fix_id = table.get("id") or table.get("fix") or table.get("name")
                if isinstance(fix_id, str):
                    found[fix_id] = table
        elif isinstance(value, dict):
            if "upstream_tests" in value or re.fullmatch(r"pr\d+", key):
                found[key] = value
            else:
                found.update(_fix_tables(value))
    return found


_ADDED_NAME_RES = (
    re.compile(r"^\+\s*(?:async\s+)?def\s+(\w+)"),
    re.compile(r"^\+\s*class\s+(\w+)"),
    re.compile(r"^\+(\w+)\s*(?::[^=]+)?=(?!=)"),                # module-level name
    re.compile(r"^\+\s+([A-Z][A-Z0-9_]+)\s*(?::[^=]+)?=(?!=)"),  # class constant, e.g. an env flag
    re.compile(r"^\+\s*self\.(\w+)\s*(?::[^=]+)?=(?!=)"),        # instance attribute
)


def series_added_names(series_dir: Path) -> frozenset[str]:
    """Every name the series' patches add: def/class names, assigned names, new modules."""
    names: set[str] = set()
    for patch in sorted(Path(series_dir).glob("*/*.patch")):
        lines = patch.read_text(errors="replace").splitlines()
        for index, line in enumerate(lines):
            if line.startswith("+++ b/") and index and lines[index - 1].strip() == "--- /dev/null":
                target = PurePosixPath(line[6:].strip())
                if target.suffix == ".py":
                    parts = list(target.with_suffix("").parts)
                    if parts and parts[0] == "python":
                        parts = parts[1:]
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    names.add(".".join(parts))
                continue
            if line.startswith("+") and not line.startswith("+++"):
                for pattern in _ADDED_NAME_RES:
                    match = pattern.match(line)
                    if match:
                        names.add(match.group(1))
    return frozenset(names)


def load_refs(series_dir: Path | None = None, fixes: list[str] | None = None,
              rev: str | None = None) -> list[TestRef]:
    """The upstream test files `fixes.toml` lists for `fixes` (all fixes when None).

    `rev` replaces every file's revision. Names the series adds are attached to each ref.
    """
    series_dir = Path(series_dir or DEFAULT_SERIES)
    fixes_toml = series_dir / "fixes.toml"
    if not fixes_toml.is_file():
        raise BadInput(f"{fixes_toml}: no such file (the pack's fix list)")
    try:
        document = tomllib.loads(fixes_toml.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise BadInput(f"{fixes_toml}: not valid TOML ({exc})") from None
    tables = _fix_tables(document)
    for fix in fixes or []:
        if fix not in tables:
            raise BadInput(f"--fix {fix}: not a fix in {fixes_toml} (known: {', '.join(sorted(tables))})")
    added = series_added_names(series_dir)
    refs: list[TestRef] = []
    for fix_id in (fixes or sorted(tables)):
        for entry in tables[fix_id].get("upstream_tests", []) or []:
            if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or (
                    rev is None and not isinstance(entry.get("rev"), str)):
                raise BadInput(f"{fixes_toml}: {fix_id}: each upstream_tests entry needs path and rev")
            ref = TestRef(entry["path"], rev or entry["rev"], fix_id, added)
            if ref not in refs:
                refs.append(ref)
    return refs


def resolve_base_url(base_url: str | None = None) -> str:
    url = (base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL).strip().rstrip("/")
    if not re.match(r"https?://[^/]+", url):
        raise BadInput(f"{url}: the upstream base URL must be an http:// or https:// address")
    return url


def check_ref(ref: TestRef) -> str | None:
    """None when the ref is well formed, else one line naming what is wrong."""
    if not _REV_RE.fullmatch(ref.rev or ""):
        return f"{ref.path}@{ref.rev}: the revision must be a commit id (7 to 40 hex digits)"
    path = PurePosixPath(ref.path)
    if (not ref.path or path.is_absolute() or ".." in path.parts or "\\" in ref.path
            or path.suffix != ".py"):
        return f"{ref.path}@{ref.rev}: not a repository-relative path to a .py file"
    return None


# ---- obtaining files --------------------------------------------------------------------------


@dataclass
class Fetched:
    ref: TestRef
    data: bytes | None = None
    sha256: str | None = None
    source: str | None = None       # URL, git repository, or "cache"
    error: str | None = None        # bad input, one line: the file is reported as `error`
    unavailable: str | None = None  # could not be reached and not cached: not run

    def to_json(self) -> dict:
        return {"path": self.ref.path, "rev": self.ref.rev, "fix": self.ref.fix,
                "sha256": self.sha256, "source": self.source,
                "error": self.error, "unavailable": self.unavailable}


class _Unreachable(Exception):
    """The base URL could not be reached (network down, refused, timed out, 5xx)."""


class _NotFound(Exception):
    """Bad input for one file: 404, not Python, too large."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def validate_python(data: bytes, where: str) -> str | None:
    """None when `data` is a Python source file, else one line saying what it is instead."""
    head = data[:512].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html", b"<head", b"<body")):
        return f"{where}: the server returned an HTML page, not a Python file"
    if not data.strip():
        return f"{where}: empty file"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return f"{where}: not UTF-8 text, not a Python file"
    try:
        ast.parse(text, filename=where)
    except SyntaxError as exc:
        return f"{where}: does not parse as Python (line {exc.lineno}: {exc.msg})"
    except ValueError as exc:
        return f"{where}: does not parse as Python ({exc})"
    return None


def upstream_checkout(package_root: Path) -> git.Repo | None:
    """The git repository when `package_root` is `python/` of a full upstream checkout."""
    root = Path(package_root).resolve()
    if root.name != "python" or not (root.parent / "test").is_dir():
        return None
    try:
        repo = git.Repo(root.parent)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None
    if not repo.working_tree_dir or Path(repo.working_tree_dir).resolve() != root.parent:
        return None
    return repo


class Fetcher:
    """Obtains test files: upstream checkouts first, then the cache and the base URL."""

    def __init__(self, base_url: str | None = None, *, checkouts: list[git.Repo] | None = None,
                 cache_dir: Path | None = None, session: requests.Session | None = None):
        self.base_url = resolve_base_url(base_url)
        self.checkouts = checkouts or []
        self.cache_dir = Path(cache_dir) if cache_dir else cache.cache_root() / "upstream-tests"
        self.session = session or requests.Session()
        self.unreachable: str | None = None  # once the server is unreachable, do not wait again

    def cache_paths(self, ref: TestRef) -> tuple[Path, Path]:
        file = self.cache_dir / ref.rev.lower() / PurePosixPath(ref.path)
        return file, file.with_name(file.name + ".sha256")

    def _cached(self, ref: TestRef) -> tuple[bytes | None, str | None]:
        """(content, recorded sha256). Content is None when missing or not matching the record."""
        file, sidecar = self.cache_paths(ref)
        if not sidecar.is_file():
            return None, None
        recorded = (sidecar.read_text().split() or [""])[0].lower()
        if not re.fullmatch(r"[0-9a-f]{64}", recorded):
            return None, None
        try:
            data = file.read_bytes()
        except OSError:
            return None, recorded
        return (data if _sha256(data) == recorded else None), recorded

    def _store(self, ref: TestRef, data: bytes) -> None:
        file, sidecar = self.cache_paths(ref)
        cache.write_file_atomic(file, data)
        # The sidecar is written last: its presence means the file beside it is complete.
        cache.write_file_atomic(sidecar, f"{_sha256(data)}  {file.name}\n".encode())

    def _from_checkout(self, ref: TestRef) -> tuple[bytes, str] | None:
        for repo in self.checkouts:
            try:
                commit = repo.commit(ref.rev)
            except (ValueError, git.BadName, git.BadObject, git.GitCommandError):
                continue
            try:
                blob = commit.tree / ref.path
            except KeyError:
                raise _NotFound(f"{ref.path}@{ref.rev}: no such file at that revision "
                                f"in {repo.working_tree_dir}") from None
            return blob.data_stream.read(), f"git:{repo.working_tree_dir}@{commit.hexsha}"
        return None

    def url(self, ref: TestRef) -> str:
        return f"{self.base_url}/{ref.rev}/{ref.path}"

    def _download(self, ref: TestRef) -> bytes:
        url = self.url(ref)
        if self.unreachable:
            raise _Unreachable(self.unreachable)
        try:
            with self.session.get(url, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT), stream=True) as resp:
                if resp.status_code >= 500 or resp.status_code == 429:
                    raise _Unreachable(f"{url}: the server answered {resp.status_code} {resp.reason}")
                if resp.status_code == 404:
                    raise _NotFound(f"{ref.path}@{ref.rev}: 404 Not Found at {url} "
                                    "(no such file at that revision)")
                if resp.status_code != 200:
                    raise _NotFound(f"{ref.path}@{ref.rev}: {url} answered {resp.status_code} {resp.reason}")
                chunks, size = [], 0
                for chunk in resp.iter_content(65536):
                    size += len(chunk)
                    if size > MAX_FILE_BYTES:
                        raise _NotFound(f"{ref.path}@{ref.rev}: {url} is larger than "
                                        f"{MAX_FILE_BYTES} bytes, not a unit test file")
                    chunks.append(chunk)
                data = b"".join(chunks)
                if "html" in resp.headers.get("Content-Type", "").lower():
                    raise _NotFound(f"{ref.path}@{ref.rev}: {url} returned an HTML page, not a Python file")
                return data
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError) as exc:
            raise _Unreachable(f"{url}: the download was interrupted ({exc.__class__.__name__})") from None
        except (requests.ConnectionError, requests.Timeout) as exc:
            self.unreachable = f"{self.base_url} is unreachable ({_short_network_reason(exc)})"
            raise _Unreachable(self.unreachable) from None
        except requests.RequestException as exc:
            raise _NotFound(f"{ref.path}@{ref.rev}: cannot download {url} ({exc.__class__.__name__})") from None

    def fetch(self, ref: TestRef) -> Fetched:
        problem = check_ref(ref)
        if problem:
            return Fetched(ref, error=problem)
        cached, recorded = self._cached(ref)
        where = f"{ref.path}@{ref.rev}"
        try:
            found = self._from_checkout(ref)
            if found:
                data, source = found
            else:
                data, source = self._download(ref), self.url(ref)
        except _NotFound as exc:
            return Fetched(ref, error=str(exc))
        except _Unreachable as exc:
            if cached is not None:
                print(f"upstream-tests: {exc}; using the cached copy of {where} "
                      f"(sha256 {recorded[:12]}...)", file=sys.stderr, flush=True)
                return Fetched(ref, cached, recorded, "cache")
            return Fetched(ref, unavailable=str(exc))
        problem = validate_python(data, f"{where} ({source})")
        if problem:
            return Fetched(ref, error=problem)
        digest = _sha256(data)
        if recorded is not None and digest != recorded:
            file, _ = self.cache_paths(ref)
            return Fetched(ref, error=(
                f"{where}: content changed upstream: sha256 {digest} from {source}, but the cache "
                f"recorded {recorded} for the same revision and path ({file}); refusing to run it"))
        if cached is None:
            self._store(ref, data)
        return Fetched(ref, data, digest, source)


def _short_network_reason(exc: Exception) -> str:
    text = str(exc)
    for pattern in (r"Failed to resolve '[^']+'", r"Connection refused", r"timed out",
                    r"Network is unreachable", r"No route to host", r"Name or service not known",
                    r"Temporary failure in name resolution", r"Connection reset by peer"):
        match = re.search(pattern, text)
        if match:
            return match.group(0)
    return exc.__class__.__name__


# ---- what a tree has -------------------------------------------------------------------------


class TreeNames:
    """Answers "does this tree have that module / name at all?" from its source files."""

    def __init__(self, package_root: Path):
        self.root = Path(package_root)
        self._defs: dict[str, set[str] | None] = {}

    def module_file(self, dotted: str) -> Path | None:
        base = self.root.joinpath(*dotted.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def module_exists(self, dotted: str) -> bool:
        if self.module_file(dotted):
            return True
        base = self.root.joinpath(*dotted.split("."))
        return base.is_dir() or any(base.parent.glob(base.name + ".*.so"))

    def module_defines(self, dotted: str, name: str) -> bool | None:
        """True/False when the module's source says; None when it cannot tell (star imports etc.)."""
        if self.module_exists(f"{dotted}.{name}"):
            return True
        if dotted not in self._defs:
            self._defs[dotted] = self._top_level_names(self.module_file(dotted))
        names = self._defs[dotted]
        if names is None:
            return None
        return name in names

    @staticmethod
    def _top_level_names(path: Path | None) -> set[str] | None:
        if path is None:
            return None
        try:
            module = ast.parse(path.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            return None
        names: set[str] = set()

        def bind(target: ast.AST) -> None:
            for node in ast.walk(target):
                if isinstance(node, ast.Name):
                    names.add(node.id)

        def visit(body: list[ast.stmt]) -> bool:
            for stmt in body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(stmt.name)
                elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    for alias in stmt.names:
                        if alias.name == "*":
                            return False
                        names.add(alias.asname or alias.name.split(".")[0])
                elif isinstance(stmt, ast.Assign):
                    for target in stmt.targets:
                        bind(target)
                elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                    bind(stmt.target)
                elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
                    if isinstance(stmt, (ast.For, ast.AsyncFor)):
                        bind(stmt.target)
                    else:
                        for item in stmt.items:
                            if item.optional_vars is not None:
                                bind(item.optional_vars)
                    if not visit(stmt.body) or not visit(getattr(stmt, "orelse", [])):
                        return False
                elif isinstance(stmt, ast.If):
                    if not visit(stmt.body) or not visit(stmt.orelse):
                        return False
                elif isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
                    blocks = [stmt.body, stmt.orelse, stmt.finalbody] + [h.body for h in stmt.handlers]
                    if not all(visit(block) for block in blocks):
                        return False
                elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                      and "globals" in ast.dump(stmt.value)):
                    return False  # globals().update(...) and similar dynamic definitions: cannot tell
            return True

        if not visit(module.body) or "__getattr__" in names:
            return None
        return names

    @cached_property
    def _all_words(self) -> set[str]:
        words: set[str] = set()
        for path in (self.root / "sglang").rglob("*.py"):
            try:
                words.update(re.findall(r"[A-Za-z_]\w*", path.read_text(errors="replace")))
            except OSError:
                continue
        return words

    def word_anywhere(self, name: str) -> bool:
        return name in self._all_words


# ---- classifying a failure ---------------------------------------------------------------------

_EXC_LINE_RE = re.compile(r"^(?:E\s+)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)): (.*)$")
_NAME_ERRORS = ("ImportError", "ModuleNotFoundError", "AttributeError")


@dataclass(frozen=True)
class Missing:
    name: str          # the qualified name the tree lacks
    leaf: str          # its last component, matched against the series' names
    kind: str          # exception type


def last_exception(message: str, text: str) -> tuple[str, str] | None:
    """(type, message) of the exception that ended the test, from JUnit's message and body."""

    def last(source: str) -> tuple[str, str] | None:
        found = None
        for line in (source or "").splitlines():
            match = _EXC_LINE_RE.match(line.strip())
            if match:
                found = (match.group(1).rsplit(".", 1)[-1], match.group(2).strip())
        return found

    from_message = last(message)
    if from_message and from_message[0] in _NAME_ERRORS:
        return from_message
    # A setup failure's message wraps the exception; the body shows the one that was raised.
    return last(text) or from_message


def missing_name(kind: str, message: str, names: TreeNames) -> Missing | None:
    """The sglang module or attribute named by an import/attribute error, when the tree lacks it."""
    message = message.strip()
    if "partially initialized module" in message or "circular import" in message:
        return None
    if kind == "ModuleNotFoundError" or (kind == "ImportError" and message.startswith("No module named")):
        match = re.search(r"No module named '([\w.]+)'", message)
        if match and match.group(1).split(".")[0] == "sglang" and match.group(1) != "sglang":
            dotted = match.group(1)
            if not names.module_exists(dotted):
                return Missing(dotted, dotted, kind)
        return None
    if kind == "ImportError":
        match = re.search(r"cannot import name '(\w+)' from '([\w.]+)'", message)
        if match and match.group(2).split(".")[0] == "sglang":
            name, module = match.groups()
            if names.module_defines(module, name) is False:
                return Missing(f"{module}.{name}", name, kind)
        return None
    if kind != "AttributeError":
        return None
    match = (re.search(r"^module '([\w.]+)' has no attribute '(\w+)'", message)
             or re.search(r"^<module '([\w.]+)'.*> does not have the attribute '(\w+)'", message))
    if match:
        module, name = match.groups()
        if module.split(".")[0] == "sglang" and names.module_defines(module, name) is False:
            return Missing(f"{module}.{name}", name, kind)
        return None
    match = (re.search(r"^<class '([\w.]+)'> does not have the attribute '(\w+)'", message)
             or re.search(r"^type object '(\w+)' has no attribute '(\w+)'", message)
             or re.search(r"^'(\w+)' object has no attribute '(\w+)'", message)
             or re.search(r"^(Mock) object has no attribute '(\w+)'", message))
    if match:
        owner, name = match.groups()
        if not names.word_anywhere(name):
            return Missing(f"{owner}.{name}", name, kind)
    return None


def static_missing_imports(source: str, names: TreeNames) -> list[Missing]:
    """Module-level `from sglang... import X` / `import sglang...` the tree cannot satisfy."""
    try:
        module = ast.parse(source)
    except SyntaxError:
        return []
    missing: list[Missing] = []
    for stmt in module.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module and (
                stmt.module == "sglang" or stmt.module.startswith("sglang.")):
            if not names.module_exists(stmt.module):
                missing.append(Missing(stmt.module, stmt.module, "ModuleNotFoundError"))
                continue
            for alias in stmt.names:
                if alias.name != "*" and names.module_defines(stmt.module, alias.name) is False:
                    missing.append(Missing(f"{stmt.module}.{alias.name}", alias.name, "ImportError"))
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.name.startswith("sglang.") and not names.module_exists(alias.name):
                    missing.append(Missing(alias.name, alias.name, "ModuleNotFoundError"))
    return missing


def _is_fix_name(missing: Missing, fix_names: frozenset[str]) -> bool:
    return missing.leaf in fix_names or missing.name in fix_names


def _scrub(text: str, tmp: str, tree: Path | None = None) -> str:
    """One line, without temp paths, tree paths or object addresses (receipts compare reasons)."""
    text = text.replace(tmp, "<tmp>")
    if tree is not None:
        text = text.replace(str(tree), "<tree>")
    text = re.sub(r"0x[0-9a-fA-F]{6,}", "0x…", text)
    text = re.sub(r"id='\d+'", "id='…'", text)
    text = " ".join(text.split())
    return text if len(text) <= REASON_LIMIT else text[: REASON_LIMIT - 1] + "…"


# ---- running ---------------------------------------------------------------------------------


def _entry(fetched: Fetched, nodeid: str, outcome: str, reason: str | None) -> dict:
    assert outcome in OUTCOMES
    return {"file": fetched.ref.path, "rev": fetched.ref.rev, "sha256": fetched.sha256,
            "nodeid": nodeid, "outcome": outcome, "reason": reason}


def _classify(outcome: str, message: str, body: str, *, names: TreeNames, fix_names: frozenset[str],
              static: list[Missing] | None, tmp: str) -> tuple[str, str]:
    tree = names.root
    """Final (outcome, reason) for a failed or errored test case."""
    found = last_exception(message, body)
    dynamic = missing_name(*found, names) if found and found[0] in _NAME_ERRORS else None
    line = f"{found[0]}: {found[1]}" if found else (message or body.strip().splitlines()[-1:] or [""])[0]
    candidates = list(static or [])
    if dynamic and all(m.name != dynamic.name for m in candidates):
        candidates.insert(0, dynamic)
    unrelated = [m for m in candidates if not _is_fix_name(m, fix_names)]
    related = [m for m in candidates if _is_fix_name(m, fix_names)]
    if unrelated:
        listed = ", ".join(m.name for m in unrelated)
        extra = f"; it also lacks {', '.join(m.name for m in related)} (added by the fixes)" if related else ""
        return "incompatible", _scrub(
            f"the tree has no {listed}: the test needs code this tree does not have{extra} ({line})", tmp, tree)
    if related:
        listed = ", ".join(m.name for m in related)
        return "failed", _scrub(f"the tree lacks {listed}, which the fixes add ({line})", tmp, tree)
    return outcome, _scrub(line, tmp, tree)


def parse_junit(xml_path: Path, fetched: Fetched, *, names: TreeNames, fix_names: frozenset[str],
                tmp: str) -> list[dict]:
    root = ET.parse(xml_path).getroot()
    stem = PurePosixPath(fetched.ref.path).stem
    source = fetched.data.decode("utf-8", errors="replace") if fetched.data else ""
    results: list[dict] = []
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        collection = classname == "" and name in (stem, f"{stem}.py", fetched.ref.path)
        if collection:
            nodeid = fetched.ref.path
        else:
            parts = classname.split(".")
            if parts and parts[0] == stem:
                parts = parts[1:]
            nodeid = "::".join([fetched.ref.path, *parts, name])
        failures = case.findall("failure")
        errors = case.findall("error")
        skipped = case.find("skipped")
        if failures or errors:
            outcome = "failed" if failures else "error"
            first = (failures or errors)[0]
            message, body = first.get("message", ""), first.text or ""
            static = static_missing_imports(source, names) if collection else None
            outcome, reason = _classify(outcome, message, body, names=names, fix_names=fix_names,
                                        static=static, tmp=tmp)
            count = len(failures) + len(errors)
            if count > 1 and outcome in ("failed", "error"):
                reason = f"{count} failures (subtests or teardown); first: {reason}"
            if collection and outcome == "error":
                reason = f"collection error: {reason}"
        elif skipped is not None:
            outcome = "skipped"
            message = skipped.get("message", "") or ""
            if message == "collection skipped":
                match = re.search(r"Skipped: (.*?)['\"]\)?$", (skipped.text or "").strip())
                message = f"whole file: {match.group(1) if match else 'skipped at import'}"
            if skipped.get("type") == "pytest.xfail":
                message = f"xfail: {message}"
            reason = _scrub(message or "skipped", tmp, names.root)
        else:
            outcome, reason = "passed", None
        results.append(_entry(fetched, nodeid, outcome, reason))
    return results


def run_file(python: str, package_root: Path, fetched: Fetched, *, names: TreeNames | None = None,
             timeout: float = PYTEST_TIMEOUT) -> list[dict]:
    """Run one fetched test file with pytest against one tree; per-test entries."""
    assert fetched.data is not None
    package_root = Path(package_root).resolve()
    names = names or TreeNames(package_root)
    fix_names = fetched.ref.fix_names
    with tempfile.TemporaryDirectory(prefix="sglang-backport-upstream-") as tmp:
        work = Path(tmp)
        test_file = work / PurePosixPath(fetched.ref.path).name
        test_file.write_bytes(fetched.data)
        # An ini file here stops pytest from picking up configuration above the temp dir.
        (work / "pytest.ini").write_text("[pytest]\n")
        path_dir = work / "path"
        path_dir.mkdir()
        junit = work / "junit.xml"
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rN", f"--junitxml={junit}",
               "--rootdir", str(work), test_file.name]
        env = probe_environ(python, package_root, path_dir)
        try:
            proc = subprocess.run(cmd, check=False, cwd=work, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return [_entry(fetched, fetched.ref.path, "error",
                           f"pytest did not finish within {timeout:.0f} s on this tree")]
        except OSError as exc:
            raise BadInput(f"{python}: cannot run pytest ({exc.strerror})") from None
        if not junit.is_file():
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
            if "No module named pytest" in proc.stderr:
                raise BadInput(f"{python}: pytest is not installed in the probe interpreter")
            return [_entry(fetched, fetched.ref.path, "error",
                           _scrub(f"pytest exited {proc.returncode} without a JUnit report: {tail[0]}", tmp))]
        results = parse_junit(junit, fetched, names=names, fix_names=fix_names, tmp=tmp)
        if not results:
            return [_entry(fetched, fetched.ref.path, "error",
                           f"no tests collected (pytest exit {proc.returncode})")]
        return results


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _package_roots(trees: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    roots: list[tuple[str, Path]] = []
    for label, root in trees:
        root = Path(root).resolve()
        if not (root / "sglang" / "__init__.py").is_file():
            raise BadInput(f"{label}: not an SGLang package root (no sglang/__init__.py in {root})")
        roots.append((label, root))
    return roots


def fetch_refs(trees: list[tuple[str, Path]], refs: list[TestRef], *, base_url: str | None = None,
               cache_dir: Path | None = None) -> list[Fetched]:
    """Obtain every ref once (upstream checkouts among `trees` first, then cache and base URL)."""
    checkouts = [repo for _, root in _package_roots(trees) if (repo := upstream_checkout(root)) is not None]
    fetcher = Fetcher(base_url, checkouts=checkouts, cache_dir=cache_dir)
    return [fetcher.fetch(ref) for ref in refs]


def run_upstream_tests(trees: list[tuple[str, Path]], refs: list[TestRef], *, python: str,
                       base_url: str | None = None, timeout: float = PYTEST_TIMEOUT,
                       cache_dir: Path | None = None, fetched: list[Fetched] | None = None) -> dict:
    """Run every ref on every tree. Returns {"trees": [...], "skipped": None | reason, "files": [...]}.

    `trees` are (label, package root) pairs. Bad files (404, HTML, unparsable, changed at a
    fixed revision) become one `error` entry per tree; files that could not be obtained
    because the base URL is unreachable become `skipped` entries; when no file at all could
    be obtained, nothing runs and `skipped` carries the reason. `fetched` reuses the result
    of `fetch_refs` for the same refs.
    """
    roots = _package_roots(trees)
    if fetched is None:
        fetched = fetch_refs(roots, refs, base_url=base_url, cache_dir=cache_dir)
    files = [f.to_json() for f in fetched]
    if not fetched:
        return {"trees": [], "skipped": "no upstream test files listed for the selected fixes",
                "files": files}
    for item in fetched:
        if item.error:
            _say(f"upstream-tests: {item.error}")
    if all(item.unavailable for item in fetched):
        reason = fetched[0].unavailable
        _say(f"upstream-tests: skipped: {reason}; no upstream test file was cached")
        return {"trees": [], "skipped": reason, "files": files}
    results = []
    for label, root in roots:
        names = TreeNames(root)
        tests: list[dict] = []
        for item in fetched:
            if item.error:
                tests.append(_entry(item, item.ref.path, "error", item.error))
            elif item.unavailable:
                tests.append(_entry(item, item.ref.path, "skipped", f"not obtained: {item.unavailable}"))
            else:
                _say(f"upstream-tests: {item.ref.path}@{item.ref.rev[:12]} on {label} ...")
                tests.extend(run_file(python, root, item, names=names, timeout=timeout))
        results.append({"tree": label, "tests": tests})
    return {"trees": results, "skipped": None, "files": files}


def with_rev(refs: list[TestRef], rev: str) -> list[TestRef]:
    return [replace(ref, rev=rev) for ref in refs]

