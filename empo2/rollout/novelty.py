"""`NoveltyCounter`: the state-visit counts n(s) behind the intrinsic reward 1/n(s), owned by the rollout worker."""

from __future__ import annotations


class NoveltyCounter:
    """Visit counts n(s) keyed by `env.state_key()`; they persist across iterations (and checkpoints),
    so a state stays familiar once the agent has seen it, which is what makes 1/n(s) an exploration
    bonus rather than per-episode noise."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def visit_step(self, keys: list[str]) -> list[int]:
        """Count every visit of one lock-step step, then read n(s) for each: rollouts that reach the same
        state at the same step get the same count, so the bonus is a function of the batch, never of the
        order the environments are stepped in (counting one environment at a time would pay the
        lowest-indexed rollout more, and std-normalised advantages would blow that up into a signal
        that encodes the rollout index)."""
        for key in keys:
            self.counts[key] = self.counts.get(key, 0) + 1
        return [self.counts[key] for key in keys]

    def __len__(self) -> int:
        return len(self.counts)

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = {str(k): int(v) for k, v in state["counts"].items()}
