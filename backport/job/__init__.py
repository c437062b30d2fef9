"""The main job (`sglang-backport run`) as a library: `run(RunOptions(spec)) -> RunOutcome`,
`run_many([...])` for several targets probed in one matrix."""

from backport.job.plan import Plan, RunOptions, default_reference, plan
from backport.job.run import RunOutcome, SeriesDoesNotApply, run, run_many

__all__ = ["Plan", "RunOptions", "RunOutcome", "SeriesDoesNotApply", "default_reference", "plan", "run",
           "run_many"]
