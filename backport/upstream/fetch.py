"""Obtaining upstream test files: an upstream checkout, the cache, or `{base_url}/{rev}/{path}`.

A file `fixes.toml` pins (`sha256` beside `rev`) is checked against its pin on every download
and every cache hit, whichever server served it, and is cached by its pin
(`<cache>/upstream-tests/sha256/<pin>/<name>`): a copy that does not match is never run. An
unpinned file (no pin yet, or an ad-hoc `--test`) is cached per server
(`<cache>/upstream-tests/servers/<host>-<hash of the base URL>/<rev>/<path>`), so one mirror's
copy is never trusted for another; at a fixed revision its content must not change on that
server. Each cached file has a `.sha256` sidecar. When the base URL cannot be reached, a
cached copy is used (pinned: if it matches the pin; unpinned: if that server served it);
without one the file is not run and the result says why (never a pass).

Each file ends in one of: obtained (`data`), `unavailable` (not fetched: a 404, the server
unreachable; the reason says which), `refused` (bytes that do not match the pin, content that
changed at a fixed revision, or not a Python file: never run, never cached), or `error` (the ref
itself is malformed: bad input).
"""

from __future__ import annotations

import ast
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import git
import requests

from backport import cache
from backport.digests import sha256_bytes
from backport.errors import BadInput
from backport.upstream.refs import TestRef, check_ref

DEFAULT_BASE_URL = "https://raw.githubusercontent.com/sgl-project/sglang"
BASE_URL_ENV = "SGLANG_BACKPORT_UPSTREAM_URL"

CONNECT_TIMEOUT = 10.0           # seconds to reach the server
READ_TIMEOUT = 60.0              # seconds between bytes
MAX_FILE_BYTES = 4 * 1024 * 1024  # a unit test file is tens of KB

log = logging.getLogger("backport.upstream")


def resolve_base_url(base_url: str | None = None) -> str:
    url = (base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL).strip().rstrip("/")
    if not re.match(r"https?://[^/]+", url):
        raise BadInput(f"{url}: the upstream base URL must be an http:// or https:// address")
    return url


@dataclass(frozen=True)
class Fetched:
    ref: TestRef
    data: bytes | None = None
    sha256: str | None = None
    source: str | None = None       # URL, git repository, or "cache"
    error: str | None = None        # the ref is malformed (bad input): reported as `error`
    unavailable: str | None = None  # not fetched (404, unreachable) and not cached: not run
    refused: str | None = None      # received but refused (pin mismatch, changed, not Python): not run

    @property
    def pinned(self) -> bool:
        """Only bytes that matched their pin are called pinned (never a refused download)."""
        return self.data is not None and self.ref.sha256 is not None and self.sha256 == self.ref.sha256

    def to_json(self) -> dict:
        return {"path": self.ref.path, "rev": self.ref.rev, "fix": self.ref.fix,
                "sha256": self.sha256, "pin": self.ref.sha256, "pinned": self.pinned, "source": self.source,
                "error": self.error, "unavailable": self.unavailable, "refused": self.refused}


class _Unreachable(Exception):
    """The base URL could not be reached (network down, refused, timed out, 5xx)."""


class _NotFound(Exception):
    """The file could not be fetched from this source: 404, too large, another HTTP answer."""


class _Refused(Exception):
    """The server sent bytes this toolkit will not run: an HTML page instead of the file."""


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


def package_roots(trees: list[tuple[str, Path]]) -> list[tuple[str, Path]]:
    """(label, resolved package root) pairs; BadInput for a directory without sglang/__init__.py."""
    roots: list[tuple[str, Path]] = []
    for label, root in trees:
        root = Path(root).resolve()
        if not (root / "sglang" / "__init__.py").is_file():
            raise BadInput(f"{label}: not an SGLang package root (no sglang/__init__.py in {root})")
        roots.append((label, root))
    return roots


class Fetcher:
    """Obtains test files: upstream checkouts first, then the cache and the base URL."""

    def __init__(self, base_url: str | None = None, *, checkouts: list[git.Repo] | None = None,
                 cache_dir: Path | None = None, session: requests.Session | None = None):
        self.base_url = resolve_base_url(base_url)
        self.checkouts = checkouts or []
        self.cache_dir = Path(cache_dir) if cache_dir else cache.cache_root() / "upstream-tests"
        self.session = session or requests.Session()
        self.unreachable: str | None = None  # once the server is unreachable, do not wait again

    def server_key(self) -> str:
        """The cache folder of this base URL: unpinned files are trusted per server, never across."""
        host = re.sub(r"[^A-Za-z0-9.-]+", "_", self.base_url.split("://", 1)[-1].split("/", 1)[0])
        return f"{host}-{hashlib.sha256(self.base_url.encode()).hexdigest()[:12]}"

    def cache_paths(self, ref: TestRef) -> tuple[Path, Path]:
        """A pinned file is kept by its pin (content-addressed: any server's copy that matches
        the pin is the file); an unpinned one by server, revision and path."""
        if ref.sha256:
            file = self.cache_dir / "sha256" / ref.sha256 / PurePosixPath(ref.path).name
        else:
            file = self.cache_dir / "servers" / self.server_key() / ref.rev.lower() / PurePosixPath(ref.path)
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
        return (data if sha256_bytes(data) == recorded else None), recorded

    def _store(self, ref: TestRef, data: bytes) -> None:
        file, sidecar = self.cache_paths(ref)
        cache.write_file_atomic(file, data)
        # The sidecar is written last: its presence means the file beside it is complete.
        cache.write_file_atomic(sidecar, f"{sha256_bytes(data)}  {file.name}\n".encode())

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
                    raise _Refused(f"{ref.path}@{ref.rev}: {url} returned an HTML page, not a Python file")
                return data
        except (requests.exceptions.ChunkedEncodingError, requests.exceptions.ContentDecodingError) as exc:
            raise _Unreachable(f"{url}: the download was interrupted ({exc.__class__.__name__})") from None
        except (requests.ConnectionError, requests.Timeout) as exc:
            self.unreachable = f"{self.base_url} is unreachable ({_short_network_reason(exc)})"
            raise _Unreachable(self.unreachable) from None
        except requests.RequestException as exc:
            raise _NotFound(
                f"{ref.path}@{ref.rev}: cannot download {url} ({exc.__class__.__name__})"
            ) from None

    def fetch(self, ref: TestRef) -> Fetched:
        problem = check_ref(ref)
        if problem:
            return Fetched(ref, error=problem)
        cached, recorded = self._cached(ref)
        where = f"{ref.path}@{ref.rev}"
        refused = None  # a pinned cache entry that does not match its pin: never run
        if ref.sha256:
            if cached is not None and recorded == ref.sha256:
                return Fetched(
                    ref, cached, recorded, "cache"
                )  # checked against the pin, not the record alone
            if recorded is not None:
                file, _ = self.cache_paths(ref)
                got = recorded if cached is not None else "unreadable or not its recorded sha256"
                refused = (f"{where}: the cached copy {file} has sha256 {got}, not the pin {ref.sha256} "
                           f"in fixes.toml; refusing to run it")
                log.warning("upstream-tests: %s; downloading it again", refused)
                cached, recorded = None, None
        try:
            found = self._from_checkout(ref)
            if found:
                data, source = found
            else:
                data, source = self._download(ref), self.url(ref)
        except _NotFound as exc:
            return Fetched(ref, unavailable=str(exc))
        except _Refused as exc:
            return Fetched(ref, refused=str(exc))
        except _Unreachable as exc:
            if refused:
                return Fetched(ref, refused=f"{refused} ({exc})")
            if cached is not None and not ref.sha256:
                log.warning("upstream-tests: %s; using the cached copy of %s from this server (unpinned, "
                            "sha256 %s...)", exc, where, (recorded or "")[:12])
                return Fetched(ref, cached, recorded, "cache")
            return Fetched(ref, unavailable=str(exc))
        digest = sha256_bytes(data)
        problem = _check(ref, data, source)
        if problem:  # never run, never cached: the received sha256 is recorded beside the pin
            return Fetched(ref, sha256=digest, source=source, refused=problem)
        if recorded is not None and digest != recorded:
            file, _ = self.cache_paths(ref)
            return Fetched(ref, sha256=digest, source=source, refused=(
                f"{where}: content changed upstream: sha256 {digest} from {source}, but the cache "
                f"recorded {recorded} from the same server for the same revision and path ({file}); "
                f"refusing to run it"))
        if cached is None and (ref.sha256 or not found):
            self._store(ref, data)  # a checkout's own files are not copied unless pinned
        return Fetched(ref, data, digest, source)

    def measure(self, ref: TestRef) -> Fetched:
        """The file as the server (or a checkout) serves it now, never from the cache: for
        measuring pins. A pinned ref is still checked against its pin."""
        problem = check_ref(ref)
        if problem:
            return Fetched(ref, error=problem)
        try:
            found = self._from_checkout(ref)
            data, source = found if found else (self._download(ref), self.url(ref))
        except _NotFound as exc:
            return Fetched(ref, unavailable=str(exc))
        except _Refused as exc:
            return Fetched(ref, refused=str(exc))
        except _Unreachable as exc:
            return Fetched(ref, unavailable=str(exc))
        problem = _check(ref, data, source)
        digest = sha256_bytes(data)
        return (Fetched(ref, sha256=digest, source=source, refused=problem) if problem
                else Fetched(ref, data, digest, source))


def _check(ref: TestRef, data: bytes, source: str) -> str | None:
    """None when `data` is a Python file and matches the ref's pin (if any), else one line."""
    where = f"{ref.path}@{ref.rev}"
    problem = validate_python(data, f"{where} ({source})")
    if problem or not ref.sha256:
        return problem
    digest = sha256_bytes(data)
    if digest != ref.sha256:
        return (f"{where}: sha256 {digest} from {source} does not match the pin {ref.sha256} in "
                f"fixes.toml; refusing to run it (a wrong mirror, or the pin is wrong)")
    return None


def _short_network_reason(exc: Exception) -> str:
    text = str(exc)
    for pattern in (r"Failed to resolve '[^']+'", r"Connection refused", r"timed out",
                    r"Network is unreachable", r"No route to host", r"Name or service not known",
                    r"Temporary failure in name resolution", r"Connection reset by peer"):
        match = re.search(pattern, text)
        if match:
            return match.group(0)
    return exc.__class__.__name__


def fetch_refs(trees: list[tuple[str, Path]], refs: list[TestRef], *, base_url: str | None = None,
               cache_dir: Path | None = None) -> list[Fetched]:
    """Obtain every ref once (upstream checkouts among `trees` first, then cache and base URL)."""
    fetcher = _fetcher(trees, base_url, cache_dir)
    return [fetcher.fetch(ref) for ref in refs]


def measure_pins(
    trees: list[tuple[str, Path]], refs: list[TestRef], *, base_url: str | None = None
) -> list[Fetched]:
    """Every ref as the server (or an upstream checkout among `trees`) serves it now, never from the
    cache: what `--print-pins` prints. A ref already pinned is checked against its pin."""
    return [_fetcher(trees, base_url).measure(ref) for ref in refs]


def _fetcher(trees: list[tuple[str, Path]], base_url: str | None, cache_dir: Path | None = None) -> Fetcher:
    """A fetcher that takes files from any upstream checkout among `trees` before the server."""
    checkouts = [repo for _, root in package_roots(trees) if (repo := upstream_checkout(root)) is not None]
    return Fetcher(base_url, checkouts=checkouts, cache_dir=cache_dir)
