"""`run --live`: the live tier as one more step of the main job, on every tree of the run.

Each role's tree (pristine, patched, reference) gets its own PD deployment, started, driven
through the live scenarios and stopped (live/tier.py). The documents name the role, not the
path of the tree, so the bundle holds no path of this machine.
"""

from __future__ import annotations

from pathlib import Path

from backport import evidence


def live_documents(trees: dict[str, evidence.TreeInput], python: str | None) -> dict[str, dict]:
    from backport.live import ensure_model, ensure_serving_env, run_live

    env = ensure_serving_env(python)
    model = ensure_model(env.python)
    roles = [role for role in evidence.ROLES if role in trees]
    documents = run_live(env, model, [(role, Path(trees[role].package_root), trees[role].version)
                                      for role in roles])
    return dict(zip(roles, documents, strict=True))
