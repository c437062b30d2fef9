"""The page-lifetime race on a real 2P1D deployment: scenario `aborted_transfer_pages_not_reused`.

Decode aborts request A while prefill A's Mooncake writes to A's pages are still in flight; a tree
without the deferred-release chain (#35049 - #41404) frees A's pages at once, request B (through
prefill B, unshaped) gets them, and A's late writes land on B's KV: B's greedy tokens differ from
plain transformers on the same weights. A tree with the chain holds A's pages until prefill's drain
ACK (or the timeout), so B waits for them and answers right.

Seeing it on a CPU needs A's transfer to take seconds: a bigger model (8 KiB of KV per token),
A's flow alone shaped to ~3 mbit in a private network namespace (netns.py), decode's pool (700)
just above A, so B's allocation falls on A's freed pages with no flush. One prefill cannot show
it (one FIFO transfer worker per decode). The client dispatches each request to the prefill and
decode it chooses, with the bootstrap fields the router would send.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from backport.live import netns
from backport.live.deployment import (
    RESERVED_DECODE_TOKENS,
    SERVER_ENV,
    Reply,
    decode_flags,
    generate,
    nccl_port_names,
    server_argv,
    wait_warmed_up,
    with_setup_flags,
)
from backport.live.environment import ServingEnv
from backport.live.model import TinyModel, ensure_model
from backport.live.reply import WordTokenizer
from backport.live.servers import LOOPBACK, Launch, Processes, Server, serve
from backport.live.setups import pythonpath_extras, server_environment, serving_for
from backport.vocab import TreeVerdict

SAFE, UNSAFE = TreeVerdict.SAFE, TreeVerdict.UNSAFE
ERROR, NOT_APPLICABLE = TreeVerdict.ERROR, TreeVerdict.NOT_APPLICABLE
NAME = "aborted_transfer_pages_not_reused"
EXPECT = ("a request aborted at decode while its KV is still in flight never lets its late writes reach the "
          "next request's pages: B (other prefill, on A's freed pages) gets exactly the reference tokens")

# 2 layers x (K, V) x 8 KV heads x 64 x fp32 = 8 KiB of KV per token
SHAPE = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8}
KV_BYTES_PER_TOKEN = 2 * 2 * 8 * 64 * 4
A_TOKENS, B_TOKENS, B_NEW = 600, 300, 64
PREFILL_POOL, DECODE_POOL = 1024, 700   # decode: A fits, A + B does not: B lands on A's freed pages
RATE = "3mbit"                          # A's 4.9 MB in ~13 s: well under Mooncake's 30 s batch limit
HOLD_RATE = "8bit"                      # the held-back control: one packet, then ~20 min per packet
ABORT_AT = 0.10                         # of A's KV bytes through the shaped class
# a tree that holds A's pages keeps B waiting until decode's 30 s timeout while A's writes are held
HOLD_LIMIT = 60.0
HOLD_LEAK = 0.05                        # of A's KV bytes passing while held: more, and the hold held nothing
MAX_TRIALS, TRIALS_BUDGET = 3, 150.0
START_TIMEOUT, REQUEST_TIMEOUT = 600.0, 120.0
LOG_NEEDLES = ("Deferred KV release", "timed out", "ABORT", "Traceback", "leak", "Failed", "failed")


def _ids(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


PROMPTS = {"a": (_ids(42, A_TOKENS), 1), "b": (_ids(43, B_TOKENS), B_NEW),
           "warm_a": (_ids(44, 64), 1), "warm_b": (_ids(45, 64), 1)}


_RIDS = itertools.count()


def race_model(python: Path) -> TinyModel:
    return ensure_model(python, name="race-llama", shape=SHAPE, prompts=PROMPTS)


@dataclass
class Pair:
    """One prefill (with its bootstrap port) and the shared decode."""
    prefill: Server
    bootstrap_port: int
    decode: Server
    tokenizer: WordTokenizer | None = None  # reads a text-only reply (0.4.7 - 0.4.10.post2: no output_ids)

    def send(self, pool: ThreadPoolExecutor, name: str, rid: str) -> tuple[Future, Future]:
        """Prefill and decode halves of one request, as the router sends them: (prefill, decode)."""
        ids, new = PROMPTS[name]
        extra = {"rid": rid, "bootstrap_host": LOOPBACK, "bootstrap_port": self.bootstrap_port,
                 "bootstrap_room": random.getrandbits(62)}
        halves = [
            pool.submit(generate, server.url, ids, max_new_tokens=new, timeout=REQUEST_TIMEOUT, extra=extra,
                        tokenizer=self.tokenizer)
            for server in (self.prefill, self.decode)
        ]
        return halves[0], halves[1]


@dataclass
class Race:
    a: Pair
    b: Pair
    shaping: netns.Shaping
    model: TinyModel
    startup_seconds: float

    def request(self, pair: Pair, name: str) -> Reply:
        with ThreadPoolExecutor(2) as pool:
            return pair.send(pool, name, f"{name}-{next(_RIDS)}")[1].result()

    def b_result(self, reply: Reply) -> dict:
        return {"b": reply.to_json(), "b_matches_reference": reply.status == 200
                and reply.tokens == self.model.reference["b"]}

    def trial(self, hold_back: bool = False) -> dict:
        """A through prefill A (shaped); at ABORT_AT of A's bytes decode aborts A; B through prefill B.
        `hold_back`: A's writes stopped from the abort until B answered (bounded by HOLD_LIMIT); it
        fails A's Mooncake batch (30 s) on a tree that holds A's pages, so it runs last."""
        a_bytes = A_TOKENS * KV_BYTES_PER_TOKEN
        rid = f"a-{next(_RIDS)}"
        started, base = time.monotonic(), netns.shaped_bytes()
        with ThreadPoolExecutor(4) as pool:
            a_prefill, a_decode = self.a.send(pool, "a", rid)
            sent = 0
            while sent < ABORT_AT * a_bytes and time.monotonic() - started < 40 and not a_decode.done():
                time.sleep(0.02)
                sent = netns.shaped_bytes() - base
            out: dict[str, Any] = {"abort_at_fraction": round(sent / a_bytes, 3), "abort_after_seconds":
                   round(time.monotonic() - started, 2)}
            if sent < ABORT_AT * a_bytes:
                out["invalid"] = "A's shaped flow never reached the abort point (A not shaped, or done)"
            if hold_back:
                self.shaping.set_rate(HOLD_RATE)
                # what passed while tc changed the rate (a loaded host: hundreds of ms) was before the
                # hold; the hold is judged from here, where the abort is sent
                out["hold_from_fraction"] = round((netns.shaped_bytes() - base) / a_bytes, 3)
            abort = requests.post(self.a.decode.url + "/abort_request", json={"rid": rid}, timeout=30)
            out["abort_status"] = abort.status_code
            b_started = time.monotonic()
            b_reply = self.b.send(pool, "b", f"b-{next(_RIDS)}")[1]
            if hold_back:
                with contextlib.suppress(TimeoutError):
                    b_reply.result(timeout=HOLD_LIMIT)
                out["held_back_seconds"] = round(time.monotonic() - b_started, 2)
                out["a_fraction_during_hold"] = round((netns.shaped_bytes() - base) / a_bytes, 3)
                self.shaping.set_rate(RATE)
                leak = hold_leak(out)
                if out.get("invalid") is None and leak:
                    out["invalid"] = leak
            reply = b_reply.result()
            out["a_fraction_when_b_answered"] = round((netns.shaped_bytes() - base) / a_bytes, 3)
            out.update(self.b_result(reply))
            out["b_wait_seconds"] = round(time.monotonic() - b_started, 2)
            out["a_prefill_status"] = a_prefill.result().status
            out["a_decode_status"] = a_decode.result().status
            out["a_bytes"] = self.settle(base)
        if out.get("invalid") is None and out["abort_status"] != 200:
            out["invalid"] = f"decode answered the abort with {out['abort_status']}"
        if out.get("invalid") is None and reply.status != 200:
            out["invalid"] = f"B got status {reply.status}: {reply.error}"
        return out

    def settle(self, base: int, quiet: float = 2.0, limit: float = 60.0) -> int:
        """Wait (bounded) until the shaped class stops sending: A's late writes are over."""
        last, still_since, started = -1, time.monotonic(), time.monotonic()
        while time.monotonic() - started < limit:
            now = netns.shaped_bytes()
            if now != last:
                last, still_since = now, time.monotonic()
            elif time.monotonic() - still_since >= quiet:
                break
            time.sleep(0.2)
        return last - base


def hold_leak(held: dict) -> str | None:
    """Why a held-back control held nothing back (HOLD_LEAK or more of A's KV passed from the hold
    taking effect to B's answer), or None."""
    leaked = held["a_fraction_during_hold"] - held["hold_from_fraction"]
    if leaked < HOLD_LEAK:
        return None
    return f"A's writes were not held back: {leaked:.3f} of A's KV passed during the hold"


def judge(controls: dict[str, dict], trials: list[dict],
          decode_log: Sequence[str] = ()) -> tuple[TreeVerdict, str]:
    """The verdict from the controls, the trials' results and decode's log lines of the trials (pure:
    unit-tested)."""
    valid = [t for t in trials if not t.get("invalid")]
    # An aborted request still answers 200 on releases up to 0.4.10.post2, so what says decode's abort
    # reached A's transfer is decode's own failed-transfer line (every release logs one).
    aborted = any("transfer failed" in line.lower() for line in decode_log)
    if (controls.get("b_alone", {}).get("b_matches_reference") and valid and not aborted
            and all(t.get("a_decode_status") == 200 and t["b_matches_reference"] for t in valid)):
        # Below 0.4.10 decode's abort does not reach its transfer queue: A is served whole, its pages
        # are never freed under its writes, and the held-back control's B waits for them (times out).
        waits = [t["b_wait_seconds"] for t in valid]
        return NOT_APPLICABLE, (
            f"decode's abort never ended A: A answered 200 after the abort in each of {len(valid)} valid "
            f"trials ({len(trials)} run) and decode logged no failed transfer, so its pages were never "
            f"freed under its writes (this release "
            f"cannot abort a request whose KV is in flight); B waited {min(waits):.1f} - {max(waits):.1f} s "
            "for them and got the reference tokens"
        )
    broken = [name for name, c in controls.items() if not c.get("b_matches_reference")]
    if broken:
        return ERROR, f"control(s) not safe: {', '.join(broken)}: the deployment cannot judge the race"
    # a held-back control whose A was never in flight held nothing back: it proves nothing
    void = [f"{name} ({c['invalid']})" for name, c in controls.items() if c.get("invalid")]
    if void:
        return ERROR, f"control(s) not valid: {', '.join(void)}"[:400]
    if not valid:
        return ERROR, f"no valid trial of {len(trials)}: " + "; ".join(t["invalid"] for t in trials)[:300]
    unsafe = sum(1 for t in valid if not t["b_matches_reference"])
    counted = f"{unsafe} of {len(valid)} valid trials unsafe ({len(trials)} run)"
    if unsafe:
        return UNSAFE, (
            f"{counted}: A's late writes landed on B's pages (B's tokens differ from the reference; "
            "B alone and B with A's writes held back match it)"
        )
    waits = [t["b_wait_seconds"] for t in valid]
    return SAFE, f"{counted}: B waited {min(waits):.1f} - {max(waits):.1f} s and got the reference tokens"


def _size(server: Server) -> int:
    try:
        return server.log.stat().st_size
    except OSError:
        return 0


def _log_lines(server: Server, offset: int) -> list[str]:
    with contextlib.suppress(OSError), open(server.log, "rb") as f:
        f.seek(offset)
        return [line.strip()[:300] for line in f.read().decode(errors="replace").splitlines()
                if any(n in line for n in LOG_NEEDLES)][:12]
    return []


@contextlib.contextmanager
def deployed_2p1d(env: ServingEnv, package_root: Path, model: TinyModel, workdir: Path,
                  extra_env: dict[str, str] | None = None, send_buffer: int | None = None,
                  version: str | None = None) -> Iterator[Race]:
    """Two prefills and one decode in the calling thread's private namespace; A's flow shaped;
    served as `version`'s serving setup has it (setups.py; the newest setup when None)."""
    setup = serving_for(version or "9999")
    if send_buffer:
        netns.set_send_buffer(send_buffer)
    workdir.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    server_env = {
        **base,
        **SERVER_ENV,
        **server_environment(setup, RESERVED_DECODE_TOKENS),
        **(extra_env or {}),
        "PYTHONPATH": env.pythonpath(package_root, pythonpath_extras(setup)),
        "PYTHONNOUSERSITE": "1",
    }

    nccl = nccl_port_names(setup)
    def decode_argv(ports: dict[str, int]) -> list[str]:
        pool = str(DECODE_POOL + setup.decode_pool_extra)
        role = (*decode_flags(package_root, setup), "--max-total-tokens", pool)
        return server_argv(env, model, with_setup_flags(setup, role, ports), ports["decode"])

    def prefill_argv(ports: dict[str, int]) -> list[str]:
        role = ("--disaggregation-mode", "prefill", "--max-total-tokens", str(PREFILL_POOL),
                "--disaggregation-bootstrap-port", str(ports["bootstrap"]))
        return server_argv(env, model, with_setup_flags(setup, role, ports), ports["prefill"])

    started = time.monotonic()
    netns.set_port_range(*netns.OTHER_RANGE)
    with Processes(workdir) as processes:
        # each on free ports, started again on others when one was taken meanwhile (three servers
        # starting at once in one namespace: pristine 0.5.16's decode died in torch's rendezvous)
        servers = serve(processes, [
            Launch("decode", decode_argv, ("decode", *nccl), server_env),
            *(Launch(name, prefill_argv, ("prefill", "bootstrap", *nccl), server_env)
              for name in ("prefill_a", "prefill_b")),
        ], "/health", START_TIMEOUT)
        decode, tokenizer = servers["decode"], WordTokenizer.load(model.path)
        # a prefill's ports are (its HTTP port, its bootstrap port[, nccl])
        pairs = [Pair(servers[n], servers[n].ports[1], decode, tokenizer) for n in ("prefill_a", "prefill_b")]
        if setup.health_before_warmup:
            wait_warmed_up([p.prefill for p in pairs] + [decode], START_TIMEOUT)
        a, b = pairs
        # A's first transfer opens its Mooncake connection from A's port block; everything else not
        netns.set_port_range(*netns.A_PORTS)
        try:
            warm = Race(a, b, netns.Shaping(0, RATE), model, 0.0).request(a, "warm_a")
        finally:
            netns.set_port_range(*netns.OTHER_RANGE)
        found = netns.data_port_from_a()
        if warm.status != 200 or found is None:
            raise RuntimeError(
                f"A's warm-up: status {warm.status}, Mooncake connection from A's ports: {found}"
            )
        shaping = netns.Shaping(found[0], RATE)
        shaping.apply()
        yield Race(a, b, shaping, model, time.monotonic() - started)


def run_race(env: ServingEnv, package_root: Path, workdir: Path, *, extra_env: dict[str, str] | None = None,
             send_buffer: int | None = None, max_trials: int = MAX_TRIALS, budget: float = TRIALS_BUDGET,
             version: str | None = None) -> dict:
    """The scenario on one tree, in the tier's result format (scenario, verdict, observed, details).
    `extra_env` and `send_buffer` make a variant (MC_TCP_PROTO=1 with a 4 MiB send buffer)."""
    started = time.monotonic()
    result = {"scenario": NAME, "must_preserve": False, "expect": EXPECT}
    reason = netns.unavailable()
    if reason is not None:
        return {**result, "verdict": NOT_APPLICABLE, "observed": reason, "details": {}, "seconds": 0.0}
    model = race_model(env.python)
    details: dict = {
        "topology": TOPOLOGY,
        "shaping": {
            "rate": RATE,
            "abort_at_fraction": ABORT_AT,
            "hold_rate": HOLD_RATE,
            "hold_limit_seconds": HOLD_LIMIT,
        },
        "environment": dict(extra_env or {}),
        "model_sha256": model.sha256,
    }
    if send_buffer:
        details["tcp_send_buffer_bytes"] = send_buffer
    try:
        with netns.private_namespace(), deployed_2p1d(env, package_root, model, workdir, extra_env,
                                                      send_buffer, version) as race:
            details["startup_seconds"] = round(race.startup_seconds, 1)
            details["shaping"]["data_port"] = race.shaping.data_port
            servers = (race.a.prefill, race.b.prefill, race.a.decode)
            controls = {"b_alone": race.b_result(race.request(race.b, "b"))}
            trials: list[dict] = []
            trials_started = time.monotonic()
            marks = {s.name: _size(s) for s in servers}
            while len(trials) < max_trials and time.monotonic() - trials_started < budget:
                trials.append(race.trial())
            details["log"] = {s.name: _log_lines(s, marks[s.name]) for s in servers}
            # last: holding A's writes back fails prefill A's Mooncake batch where B waits for A's pages
            marks = {s.name: _size(s) for s in servers}
            controls["held_back"] = race.trial(hold_back=True)
            details["held_back_log"] = {s.name: _log_lines(s, marks[s.name]) for s in servers}
            details.update(controls=controls, trials=trials)
        verdict, observed = judge(controls, trials, details["log"].get("decode", []))
        # a hold resolved by decode's timeout during a trial is not a drain ACK
        timeouts = [line for line in details["log"].get("decode", []) if "timed out" in line]
        if verdict == SAFE and timeouts:
            observed += "; decode released A's pages through the deferred-release timeout, not a drain ACK"
        details["released_through_timeout"] = bool(timeouts)
    except Exception as exc:  # noqa: BLE001 - a deployment that breaks is this tree's error verdict
        verdict, observed = ERROR, f"{type(exc).__name__}: {exc}"[:600]
    return {**result, "verdict": verdict, "observed": observed, "details": details,
            "seconds": round(time.monotonic() - started, 1)}


TOPOLOGY = {
    "name": "2P1D",
    "prefills": 2,
    "decodes": 1,
    "network": "private namespace, lo MTU 1500",
    "dispatch": "client sends each half with the router's bootstrap fields",
    "model": "2 layers, hidden 512, 8 KV heads (8 KiB KV/token)",
    "a_tokens": A_TOKENS,
    "b_tokens": B_TOKENS,
    "b_new_tokens": B_NEW,
    "decode_pool": DECODE_POOL,
    "prefill_pool": PREFILL_POOL,
    "transfer": "mooncake over TCP",
}
