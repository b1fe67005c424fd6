"""The MiniSci environment behind `make_env("minisci", ...)`, its task catalogue and gold paths.

A task instance is (family, variation); its house is generated from a seed derived from the two
with `stable_hash`, so the same instance is the same house in every process. Variations
0..NUM_VARIATIONS-1 of each family are split into train/dev/test in an order fixed by a hash of
(family, variation);
the change-state family is held out as the out-of-distribution task.
"""

from __future__ import annotations

import operator
import random
from typing import Any

from empo2.envs.actions import resolve_action
from empo2.envs.base import Catalogue, StepResult, hash_splits, register_env, stable_hash
from empo2.envs.minisci.commands import execute, valid_actions
from empo2.envs.minisci.families import FAMILIES, OOD_FAMILIES, Task
from empo2.envs.minisci.layout import Difficulty
from empo2.envs.minisci.world import World

NUM_VARIATIONS = 300  # per family
SPLIT_SIZES = {"train": 150, "dev": 75, "test": 75}
DEFAULT_TASK = next(iter(FAMILIES))


def catalogue() -> Catalogue:
    """Per family, disjoint train/dev/test variation lists (150/75/75): the variations ordered by a
    hash of (family, variation) and cut in that order; change-state is out-of-distribution."""
    variations = {family: hash_splits("minisci-split", family, SPLIT_SIZES) for family in FAMILIES}
    return Catalogue(variations=variations, ood_tasks=list(OOD_FAMILIES))


def build(family: str, variation: int, difficulty: Difficulty) -> tuple[World, Task]:
    """The initial world and task of one instance (raises ValueError on an unknown instance)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown MiniSci task {family!r}; known: {sorted(FAMILIES)}")
    variation = operator.index(variation)
    if not 0 <= variation < NUM_VARIATIONS:
        raise ValueError(f"variation must be in [0, {NUM_VARIATIONS}), got {variation}")
    rng = random.Random(int(stable_hash("minisci", family, str(variation)), 16))
    return FAMILIES[family].build(rng, difficulty)


def gold_actions(task: str, variation: int, **difficulty: Any) -> list[str]:
    """A winning action path for an instance; `difficulty` takes the env's house kwargs."""
    world, instance = build(task, variation, Difficulty(**difficulty))
    return instance.gold(world)


@register_env("minisci")
class MiniSciEnv:
    """A small ScienceWorld-like text lab (see the package docstring).

    Args:
        max_steps: episode step budget, invalid actions included; None uses the family default
            (find-living-thing 30, power-component 30, measure-temperature 40, mix-paint 40,
            change-state 40).
        action_correction: replace an action that is not accepted by the valid action with the
            highest word overlap (`empo2.envs.actions.resolve_action`).
        reward_scale: reward = change of score (0-100) times this.
        seed: seeds the draw of a train variation when `reset` is given none.
        num_rooms, num_distractors, num_decoys, closed_doors, hide_prob: house difficulty, see
            `empo2.envs.minisci.layout.Difficulty`.
    """

    def __init__(
        self,
        max_steps: int | None = None,
        action_correction: bool = True,
        reward_scale: float = 1.0,
        seed: int = 0,
        num_rooms: int = 6,
        num_distractors: int = 2,
        num_decoys: int = 2,
        closed_doors: bool = False,
        hide_prob: float = 0.0,
    ) -> None:
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be positive, got {max_steps}")
        self.difficulty = Difficulty(num_rooms, num_distractors, num_decoys, closed_doors, hide_prob)
        self.max_steps_override = max_steps
        self.action_correction = action_correction
        self.reward_scale = reward_scale
        self._rng = random.Random(seed)
        self._catalogue = catalogue()
        self.task_description = ""
        self.task_name = DEFAULT_TASK
        self.variation = -1
        self.max_steps = 0
        self._world: World | None = None
        self._task: Task | None = None
        self._score = 0
        self._steps = 0
        self._done = True

    # ----- episode ------------------------------------------------------------------------
    def reset(self, task: str | None = None, variation: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start an instance; `task` defaults to the previous one (first: find-living-thing),
        `variation` to a train variation drawn from the env's seeded generator."""
        family = self.task_name if task is None else task
        if family not in FAMILIES:
            raise ValueError(f"unknown MiniSci task {family!r}; known: {sorted(FAMILIES)}")
        if variation is None:
            variation = self._rng.choice(self._catalogue.split(family, "train"))
        self._world, self._task = build(family, variation, self.difficulty)
        self.task_name, self.variation = family, variation
        self.task_description = self._task.description
        self.max_steps = self.max_steps_override or self._task.max_steps
        self._score, self._steps, self._done = 0, 0, False
        info = self._info(False, False, "", None, False)
        info["task_description"] = self.task_description
        return self._world.look_around(), info

    def step(self, action_text: str) -> StepResult:
        if self._world is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            info = self._info(False, False, "", None, False)
            return StepResult("The episode has ended; reset to start a new one.", 0.0, True, info)
        world, task = self._world, self._task
        action, parsed = resolve_action(action_text, None, False)
        obs = execute(world, action, task) if action else None
        corrected = False
        if obs is None and self.action_correction and action:
            action, parsed = resolve_action(action_text, valid_actions(world), True)
            obs = execute(world, action, task) if action else None
            corrected = parsed["corrected"]
        self._steps += 1
        if obs is None:
            obs, action = "No known action matches that input.", None
        else:
            events = world.tick()
            if events:
                obs = obs + " " + " ".join(events)
        before = self._score
        won = False
        if world.failed:
            self._score, self._done = 0, True
        else:
            progress, won = task.progress(world)
            self._score = max(self._score, progress)
            self._done = won
        truncated = not self._done and self._steps >= self.max_steps
        self._done = self._done or truncated
        info = self._info(action is None, corrected, parsed["parsed_action"], action, truncated)
        return StepResult(obs, (self._score - before) * self.reward_scale, self._done, info)

    def _info(
        self, invalid: bool, corrected: bool, parsed: str, action: str | None, truncated: bool
    ) -> dict[str, Any]:
        return {
            "score": self._score,
            "won": self._score == 100,
            "failed": self._world.failed,
            "invalid_action": invalid,
            "corrected": corrected,
            "parsed_action": parsed,
            "action": action,
            "steps": self._steps,
            "max_steps": self.max_steps,
            "truncated": truncated,
            "task": self.task_name,
            "variation": self.variation,
        }

    # ----- queries ------------------------------------------------------------------------
    def valid_actions(self) -> list[str]:
        if self._world is None:
            raise RuntimeError("call reset() before valid_actions()")
        return valid_actions(self._world)

    def gold_actions(self) -> list[str]:
        """A winning path for the current instance, from its initial state."""
        world, task = build(self.task_name, self.variation, self.difficulty)
        return task.gold(world)

    def state_key(self) -> str:
        """Stable hash of what novelty should count: instance, room, inventory, focus, measured
        things, wiring, open doors and containers, and where and in what state the task's key
        things are (clutter moved around does not make a new state)."""
        if self._world is None:
            raise RuntimeError("call reset() before state_key()")
        world = self._world
        parts = [
            self.task_name,
            str(self.variation),
            world.location,
            "|".join(sorted(world.inventory)),
            "|".join(world.focused),
            "|".join(sorted(world.measured)),
        ]
        for name in self._task.key_things:
            thing = world.things.get(name)
            parts.append(f"{name}@{thing.parent}:{thing.phase()}:{thing.active}" if thing else f"{name}@-")
        parts.append("".join("1" if is_open else "0" for is_open in world.doors.values()))
        parts.append("".join("1" if t.is_open else "0" for t in world.things.values() if t.closable))
        parts.append("|".join(sorted(f"{a}={b}" for a, ends in world.links.items() for b in ends if a < b)))
        return stable_hash(*parts)

    def close(self) -> None:
        self._world = self._task = None
        self._done = True
