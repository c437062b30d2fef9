"""The per-request cost of the transferred-coverage check (sbp-transfer-coverage).

Decode's side runs in the metadata gate (``_apply_metadata_gate``) for every request whose
transfer polls complete; prefill's side is one int32 store with the last chunk's metadata.
On a tree with only this fix applied, in the CPU probe interpreter, this times, alternately
and ``--repeat`` times each over a batch of ``--batch`` completed requests:

- decode: the gate with the check on (the default) against the same gate with
  ``SGLANG_DISAGGREGATION_TRANSFER_COVERAGE_CHECK=0`` (the floor: upstream's own readiness
  check of the metadata row);
- prefill: ``MetadataBuffers.set_buf`` followed by ``set_transferred_coverage`` against
  ``set_buf`` alone (the floor).

It prints nanoseconds per request and each ratio against its floor, measured in the same run.

    python benchmarks/bench_transfer_coverage.py [SPEC] [--repeat N] [--batch N]   (default sglang==0.5.19)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

CHILD = r"""
import inspect, json, os, statistics, sys, time
from types import SimpleNamespace
import torch
from sglang.srt.disaggregation import utils
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

batch, repeat = int(sys.argv[1]), int(sys.argv[2])
params = inspect.signature(utils.MetadataBuffers.__init__).parameters
kw = dict(size=batch, hidden_size=16, hidden_states_dtype=torch.float32)
kw = {k: v for k, v in kw.items() if k in params}
buffers = utils.MetadataBuffers(**kw)

def request(i):
    req = Req(rid=f"r{i}", origin_input_text="b", origin_input_ids=list(range(1, 201)),
              sampling_params=SamplingParams(max_new_tokens=8))
    req.bootstrap_host, req.bootstrap_port, req.bootstrap_room = "10.0.0.2", 8998, 1000 + i
    req.metadata_buffer_index = i
    req.output_ids.append(7)
    kv = getattr(req, "kv", None)
    if kv is not None and hasattr(kv, "kv_committed_len"):
        kv.kv_committed_len = 200
    else:
        req.kv_committed_len = 200
    return req

reqs = [request(i) for i in range(batch)]
for r in reqs:  # prefill wrote each row: metadata, room and coverage
    buffers.set_buf(r)
    buffers.bootstrap_room[r.metadata_buffer_index, 0] = r.bootstrap_room
    buffers.set_transferred_coverage(r.metadata_buffer_index, 200)
decode_reqs = [
    SimpleNamespace(req=r, metadata_buffer_index=r.metadata_buffer_index, transfer_coverage_error=None)
    for r in reqs
]
gate_args = inspect.signature(utils._apply_metadata_gate).parameters
extra = ([SimpleNamespace(disaggregation_transfer_backend="mooncake")] if len(gate_args) == 4 else [])

def gate(check):
    os.environ["SGLANG_DISAGGREGATION_TRANSFER_COVERAGE_CHECK"] = "1" if check else "0"
    polls = [int(KVPoll.Success)] * batch
    t = time.perf_counter_ns()
    utils._apply_metadata_gate(polls, decode_reqs, buffers, *extra)
    elapsed = time.perf_counter_ns() - t
    assert polls == [int(KVPoll.Success)] * batch  # complete handoffs: none refused
    return elapsed / batch

def prefill(record):
    t = time.perf_counter_ns()
    for r in reqs:
        buffers.set_buf(r)
        if record:
            buffers.set_transferred_coverage(r.metadata_buffer_index, 200)
    return (time.perf_counter_ns() - t) / batch

for f in (gate, prefill):  # warm up
    f(True); f(False)
out = {"decode_on": [], "decode_floor": [], "prefill_on": [], "prefill_floor": []}
for _ in range(repeat):
    out["decode_floor"].append(gate(False)); out["decode_on"].append(gate(True))
    out["prefill_floor"].append(prefill(False)); out["prefill_on"].append(prefill(True))
print(json.dumps({k: statistics.median(v) for k, v in out.items()}))
"""


def main() -> int:
    from backport.engine import apply_series
    from backport.pack import load_pack
    from backport.probing.env import ensure_env
    from backport.probing.harness import probe_environ
    from backport.sources import materialise
    from backport.tree import clone_tree

    parser = argparse.ArgumentParser()
    parser.add_argument("spec", nargs="?", default="sglang==0.5.19")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()

    repo = Path(__file__).resolve().parent.parent
    python = str(ensure_env())
    pristine = materialise(args.spec).tree
    with tempfile.TemporaryDirectory(prefix="bench-coverage-") as tmp:
        tree = clone_tree(pristine, Path(tmp), Path(tmp) / "tree")
        apply_series(tree.path, load_pack(repo / "patches"), pristine.version, only=["sbp-transfer-coverage"])
        env = probe_environ(python, tree.path, repo)
        proc = subprocess.run([python, "-c", CHILD, str(args.batch), str(args.repeat)], env=env,
                              capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark child failed:\n{proc.stderr[-2000:]}")
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    for side, what in (("decode", "metadata gate"), ("prefill", "last-chunk metadata")):
        on, floor = m[f"{side}_on"], m[f"{side}_floor"]
        print(
            f"{args.spec} {side} {what}: {on:.0f} ns/request with the check, {floor:.0f} ns floor "
            f"(+{on - floor:.0f} ns); ratio {on / floor:.2f}x (medians of {args.repeat}, batch {args.batch})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
