"""`run --live`: the live tier as one more step of the main job, on every tree of the run.

Each role's tree (pristine, patched, reference) gets its own PD deployment, started, driven
through the live scenarios and stopped (live/tier.py). The documents name the role, not the
path of the tree, so the bundle holds no path of this machine. The reference tree is the same
for every target of one invocation (`run A B --live`): its deployment runs once and its document
is reused, keyed by the tree's content digest, so it is the same code that answered.
"""

from __future__ import annotations

from backport import evidence
from backport.records import LiveResult

# (serving interpreter, reference tree digest) -> its live document, for this process only
_REFERENCE_RUNS: dict[tuple[str, str], LiveResult] = {}


def live_documents(trees: dict[str, evidence.TreeInput], python: str | None) -> dict[str, LiveResult]:
    from backport.live import ensure_model, ensure_serving_env, run_live

    env = ensure_serving_env(python)
    model = ensure_model(env.python)
    roles = [role for role in evidence.ROLES if role in trees]
    ref = trees.get("reference")
    ref_key = (str(env.python), ref.tree_digest) if ref is not None and ref.tree_digest else None
    to_run = [role for role in roles if not (role == "reference" and ref_key in _REFERENCE_RUNS)]
    documents = dict(
        zip(
            to_run,
            run_live(
                env, model, [(role, trees[role].root(), trees[role].version) for role in to_run]
            ),
            strict=True,
        )
    )
    if ref_key in _REFERENCE_RUNS:
        documents["reference"] = _REFERENCE_RUNS[ref_key]
    elif ref_key is not None and not documents["reference"].broke:
        # a scenario that broke is tried again with the next target
        _REFERENCE_RUNS[ref_key] = documents["reference"]
    return {role: documents[role] for role in roles}
