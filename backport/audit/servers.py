"""What a running SGLang server says about itself: `/server_info` and `/model_info`.

`/server_info` is the server's resolved `ServerArgs` merged with the scheduler's start-up
report (`max_total_num_tokens`, the KV pool in tokens, and `max_req_input_len`); releases
before it answer only `/get_server_info`. Nothing here judges: a field that is missing or
of the wrong type is recorded as a reason, and the gates turn reasons into `unknown`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from backport.advisories import settings_of
from backport.audit.fetch import Limits, describe, request
from backport.errors import BadInput

SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
CHECKSUM_FLAG = "disaggregation_enable_kv_checksum"
PD_ROLES = ("prefill", "decode")
PARALLEL_READS = 16       # servers read at once: 200 silent ones cost 13 timeouts, not 200


@dataclass(frozen=True)
class ServerFacts:
    url: str
    endpoint: str | None                  # the path that answered, None when none did
    error: str | None                     # why nothing usable was read
    role: str | None = None               # disaggregation_mode: prefill | decode | null
    version: str | None = None
    backend: str | None = None            # disaggregation_transfer_backend
    pool_tokens: int | None = None        # max_total_num_tokens
    max_req_input_len: int | None = None
    context_length: int | None = None
    context_source: str | None = None
    page_size: int | None = None
    kv_checksum: bool | None = None       # None: the document has no such field
    is_server_args_dump: bool = False     # True when the document carries ServerArgs fields
    mem_fraction_static: float | None = None   # what sizes the KV pool, for gate 1's remedy
    problems: tuple[str, ...] = field(default_factory=tuple)   # unreadable fields, by name
    # the server arguments the advisories' conditions read (backport/advisories.py SETTINGS; the admin
    # key as configured or not): kept for the advisories table, never printed as such
    settings: dict = field(default_factory=dict)

    @property
    def is_pd(self) -> bool:
        return self.role in PD_ROLES

    def to_json(self) -> dict:
        return {
            "url": self.url, "endpoint": self.endpoint, "error": self.error, "role": self.role,
            "version": self.version, "transfer_backend": self.backend,
            "max_total_num_tokens": self.pool_tokens, "max_req_input_len": self.max_req_input_len,
            "context_length": self.context_length, "context_source": self.context_source,
            "page_size": self.page_size, CHECKSUM_FLAG: self.kv_checksum,
            "mem_fraction_static": self.mem_fraction_static,
            "problems": list(self.problems),
        }


def check_url(url: str, flag: str = "--server") -> str:
    """The URL without a trailing slash; bad input, naming `flag`, when it is not http(s)://host[:port]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInput(f"{flag} {url}: not an http(s)://HOST[:PORT] URL")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise BadInput(f"{flag} {url}: malformed port") from None
    return url.rstrip("/")


def _get_json(base: str, paths: tuple[str, ...], limits: Limits):
    """(path, document, error) from the first path that answers 200 with a JSON object."""
    error = None
    for path in paths:
        reply = request("GET", base + path, limits)
        if reply.status == 404:
            error = f"{base}{path}: HTTP 404"
            continue
        why = describe(reply)
        if why:
            return None, None, why
        document = reply.json()
        if document is None:
            return None, None, f"{base}{path}: the answer is not JSON (garbled)"
        if not isinstance(document, dict):
            return None, None, f"{base}{path}: the answer is not a JSON object (garbled)"
        return path, document, None
    return None, None, error


def _integer(document: dict, key: str, problems: list[str]) -> int | None:
    if key not in document:
        problems.append(f"{key}: missing")
        return None
    value = document[key]
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{key}: not an integer ({value!r})")
        return None
    return value


def facts_from_documents(url: str, endpoint: str, info: dict, model_info: dict | None) -> ServerFacts:
    """Read the gate fields out of one server's documents."""
    problems: list[str] = []
    pool = _integer(info, "max_total_num_tokens", problems)
    max_input = _integer(info, "max_req_input_len", problems)
    page_size = _integer(info, "page_size", problems)
    context, source = None, None
    if info.get("context_length") is not None:
        context, source = _integer(info, "context_length", problems), f"{endpoint} context_length"
    else:
        for key in ("context_length", "context_len", "max_context_length"):
            if model_info and model_info.get(key) is not None:
                context, source = _integer(model_info, key, problems), f"/model_info {key}"
                break
        else:
            problems.append("context_length: not set in the server arguments (the model's own "
                            "context applies) and not reported by /model_info")
    role = info.get("disaggregation_mode")
    if role is None and model_info:
        role = model_info.get("disaggregation_mode")
    if not isinstance(role, str):
        problems.append(f"disaggregation_mode: {'missing' if role is None else repr(role)}")
        role = None
    backend = info.get("disaggregation_transfer_backend")
    checksum = info.get(CHECKSUM_FLAG)
    if checksum is not None and not isinstance(checksum, bool):
        problems.append(f"{CHECKSUM_FLAG}: not a boolean ({checksum!r})")
        checksum = None
    version = info.get("version")
    fraction = info.get("mem_fraction_static")
    return ServerFacts(
        url=url,
        endpoint=endpoint,
        error=None,
        role=role,
        version=version if isinstance(version, str) else None,
        backend=backend if isinstance(backend, str) else None,
        pool_tokens=pool,
        max_req_input_len=max_input,
        context_length=context,
        context_source=source if context is not None else None,
        page_size=page_size,
        kv_checksum=checksum,
        is_server_args_dump="disaggregation_mode" in info and "model_path" in info,
        mem_fraction_static=float(fraction)
        if isinstance(fraction, (int, float)) and not isinstance(fraction, bool)
        else None,
        problems=tuple(problems),
        settings=settings_of(info),
    )


def fetch_server(url: str, *, timeout: float = 10.0, limits: Limits | None = None) -> ServerFacts:
    """Fetch and read one server; an unreachable or unreadable server is a ServerFacts with an error."""
    base = check_url(url)
    limits = limits or Limits(timeout, timeout * 4)
    endpoint, info, error = _get_json(base, SERVER_INFO_PATHS, limits)
    if info is None:
        return ServerFacts(url=base, endpoint=None, error=error or "no server info endpoint answered")
    _, model_info, _ = _get_json(base, MODEL_INFO_PATHS, limits)
    return facts_from_documents(base, endpoint, info, model_info)


def fetch_servers(urls: list[str], limits: Limits) -> tuple[ServerFacts, ...]:
    """Every server read, PARALLEL_READS at a time, in the order given, all within `limits`."""
    if not urls:
        return ()
    with ThreadPoolExecutor(max_workers=min(PARALLEL_READS, len(urls))) as pool:
        return tuple(pool.map(lambda u: fetch_server(u, limits=limits), urls))
