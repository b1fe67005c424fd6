"""Fault injection for the kill-and-resume tests: `EMPO2_FAULT=<point>:<iteration>` SIGKILLs the process.

Points (iterations count from 0, like `train/iteration`):
  rollout     in `RolloutCallback.collect_rollouts`, after the episodes were played and their tips added to memory,
              before the iteration's samples reach the trainer
  update      in `EMPO2Module.training_step`, right after the iteration's first optimiser step
  checkpoint  in `AtomicCheckpointIO.save_checkpoint`, after the checkpoint's bytes are in the temp file and
              before it is renamed into place

SIGKILL rather than an exception: nothing gets to clean up or flush, exactly as with an OOM kill or a
preempted node. With the variable unset, `maybe_fail` is a dictionary lookup and nothing else.
"""

from __future__ import annotations

import os
import signal

ENV_VAR = "EMPO2_FAULT"
POINTS = ("rollout", "update", "checkpoint")


def maybe_fail(point: str, iteration: int) -> None:
    """Kill this process with SIGKILL when `EMPO2_FAULT` names this point and iteration."""
    spec = os.environ.get(ENV_VAR)
    if not spec:
        return
    name, _, at = spec.partition(":")
    if name not in POINTS or not at.isdigit():
        raise ValueError(f"{ENV_VAR}={spec!r}: expected <point>:<iteration> with point one of {list(POINTS)}")
    if name == point and int(at) == iteration:
        os.kill(os.getpid(), signal.SIGKILL)
