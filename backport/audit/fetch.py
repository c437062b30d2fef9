"""Every HTTP read of the audit, bounded in seconds and bytes, and never redirected.

A server the audit talks to may be slow, huge, hostile or simply wrong, so no answer it gives can
make the audit wait, grow or wander:

* seconds: each request has a real deadline (`--timeout`), and all requests together have one
  (`--total-timeout`). requests' own timeout bounds each socket read only, so a server dripping a
  byte every few seconds would never time out; here a watchdog shuts the request's socket down
  when its deadline passes, whatever phase (headers or body) it is in;
* bytes: the body is streamed and dropped past `MAX_REPLY_BYTES` (no compression is asked for);
* redirects: never followed (a 3xx is an answer naming its Location); proxies and .netrc from
  the environment are not used, so a request goes to the URL given and nowhere else.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

MAX_REPLY_BYTES = 4 * 1024 * 1024
_CHUNK = 64 * 1024
_current = threading.local()   # the watchdog of the request this thread is making


class _Watchdog:
    """Shuts down one request's sockets when its deadline passes (unblocks a read in progress)."""

    def __init__(self):
        self.fired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.fired:
                _shut(sock)

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _watched_new_conn(base):
    def _new_conn(self):
        sock = base._new_conn(self)
        watchdog = getattr(_current, "watchdog", None)
        if watchdog is not None:
            watchdog.add(sock)
        return sock
    return _new_conn


class _Conn(HTTPConnection):
    _new_conn = _watched_new_conn(HTTPConnection)


class _TLSConn(HTTPSConnection):
    _new_conn = _watched_new_conn(HTTPSConnection)


class _Pool(HTTPConnectionPool):
    ConnectionCls = _Conn


class _TLSPool(HTTPSConnectionPool):
    ConnectionCls = _TLSConn


def _session(api_key: str | None) -> requests.Session:
    session = requests.Session()
    session.trust_env = False          # no proxy or .netrc from the environment: the URL given, only
    adapter = HTTPAdapter(max_retries=0)
    adapter.poolmanager.pool_classes_by_scheme = {"http": _Pool, "https": _TLSPool}
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.headers["Accept-Encoding"] = "identity"
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    return session


@dataclass
class Limits:
    """The audit's bounds: seconds per request, one deadline for all requests, the API key."""

    per_request: float
    total: float
    api_key: str | None = None
    deadline: float = field(default=0.0)

    def __post_init__(self):
        self.deadline = time.monotonic() + self.total


@dataclass(frozen=True)
class Reply:
    url: str
    status: int | None          # None: no complete answer (error says why)
    seconds: float
    body: bytes = b""
    location: str | None = None
    error: str | None = None
    keyed: bool = False         # an API key was sent

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self):
        """The body as JSON, or None when it is not JSON."""
        import json

        try:
            return json.loads(self.body)
        except ValueError:
            return None


def _printable(text: str | None, limit: int = 200) -> str | None:
    """A server's header as one short printable line (it goes to the operator's terminal)."""
    if text is None:
        return None
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if len(clean) <= limit else clean[:limit] + "..."


def _why(exc: Exception, seconds: float) -> str:
    """A short cause for a request that got no answer (requests' own text runs to 300 characters)."""
    text = str(exc)
    if isinstance(exc, requests.ConnectTimeout):
        return f"unreachable: no connection within {seconds:g} s"
    if isinstance(exc, requests.Timeout) or "timed out" in text:   # a socket timeout can beat the watchdog
        return f"no complete answer within {seconds:g} s"
    for needle, cause in (("Connection refused", "connection refused"),
                          ("Name or service not known", "host name not resolved"),
                          ("Failed to resolve", "host name not resolved"),
                          ("No route to host", "no route to host"),
                          ("Network is unreachable", "network unreachable")):
        if needle in text:
            return f"unreachable: {cause}"
    if isinstance(exc, requests.exceptions.SSLError):
        return "unreachable: TLS handshake failed"
    return f"the connection broke before a complete answer ({type(exc).__name__})"


def request(method: str, url: str, limits: Limits, *, json_body=None) -> Reply:
    """One request within the audit's bounds; an answer of any status is a Reply, and so is no
    answer (status None, with the reason)."""
    started = time.monotonic()
    seconds = min(limits.per_request, limits.deadline - started)
    if seconds <= 0:
        return Reply(url, None, 0.0, error=f"not sent: the audit's total time (--total-timeout "
                                           f"{limits.total:g} s) ran out")
    watchdog = _Watchdog()
    timer = threading.Timer(seconds, watchdog.fire)
    timer.daemon = True
    _current.watchdog = watchdog
    timer.start()
    status, location, body, error = None, None, b"", None
    try:
        with _session(limits.api_key) as session, session.request(
                method, url, json=json_body, timeout=(seconds, seconds), allow_redirects=False,
                stream=True) as response:
            status, location = response.status_code, _printable(response.headers.get("Location"))
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > MAX_REPLY_BYTES:
                error = (
                    f"an answer of {int(declared):,} bytes, above the audit's limit of {MAX_REPLY_BYTES:,}"
                )
            else:
                chunks, size = [], 0
                for chunk in response.iter_content(_CHUNK):
                    size += len(chunk)
                    if size > MAX_REPLY_BYTES:
                        error = f"an answer above the audit's limit of {MAX_REPLY_BYTES:,} bytes"
                        break
                    chunks.append(chunk)
                body = b"".join(chunks)
    except (requests.RequestException, OSError) as exc:
        error = None if watchdog.fired else _why(exc, seconds)
    finally:
        timer.cancel()
        _current.watchdog = None
    if watchdog.fired:
        status, error = None, f"no complete answer within {seconds:g} s" + (
            " (the audit's total time, --total-timeout, ran out)" if seconds < limits.per_request else "")
    elif error and status is not None:
        status, body = None, b""
    return Reply(
        url, status, round(time.monotonic() - started, 3), body, location, error, bool(limits.api_key)
    )


def describe(reply: Reply, who: str = "the server") -> str | None:
    """Why a reply is not a usable answer, in one line naming the URL (None for a 2xx)."""
    if reply.status is None:
        return f"{reply.url}: {reply.error}"
    if 300 <= reply.status < 400:
        return (f"{reply.url}: HTTP {reply.status} redirect to {reply.location or '(no Location)'}: not "
                "followed (the audit reads only the URLs it was given)")
    if reply.status in (401, 403):
        return f"{reply.url}: HTTP {reply.status}: {api_key_hint(reply, who)}"
    if not 200 <= reply.status < 300:
        return f"{reply.url}: HTTP {reply.status}"
    return None


def api_key_hint(reply: Reply, who: str) -> str:
    if reply.keyed:
        return f"{who} refuses the API key given with --api-key"
    return f"{who} wants an API key: --api-key"
