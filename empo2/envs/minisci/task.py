"""The task-instance interface every MiniSci family implements, and the placement helpers the
families share."""

from __future__ import annotations

import random

from empo2.envs.minisci.layout import Difficulty
from empo2.envs.minisci.world import World


class Task:
    """One generated task instance. `progress` returns the milestone score (0-100) of a state and
    whether the task is won; the environment keeps the best score reached."""

    family = ""
    max_steps = 30  # default episode budget of the family

    def __init__(self, description: str, key_things: tuple[str, ...], sought: tuple[str, ...] = ()) -> None:
        self.description = description
        self.key_things = key_things  # the things whose state the novelty key tracks
        # the things the house hides from the agent (placed by `place_key`): what a search must find,
        # so what a hindsight tip about the house should locate
        self.sought = sought
        # the look-alikes the house sets as the trap (a wrong `focus on` ends the episode), the first of them in
        # the room a prior points to: build-time knowledge for scripted agents, never shown to a policy
        self.lookalikes: tuple[str, ...] = ()

    @property
    def signature(self) -> str:
        """The words of the description that tell this instance from another of its family (which box, which
        component...): what a hindsight tip may repeat so that a reader can tell its own instance's tips from
        another's by comparing them with its task (`TipPriorSettings.tip_signature`)."""
        raise NotImplementedError

    @classmethod
    def build(cls, rng: random.Random, difficulty: Difficulty) -> tuple[World, Task]:
        """The house of one variation, with the agent placed, and the task instance set in it."""
        raise NotImplementedError

    def accepts_focus(self, world: World, name: str) -> bool:
        raise NotImplementedError

    def progress(self, world: World) -> tuple[int, bool]:
        raise NotImplementedError

    def gold(self, world: World) -> list[str]:
        """A shortest-known winning action path, planned on the world in its initial state."""
        raise NotImplementedError


def decoy_rooms(first: str, second: str, count: int) -> list[str]:
    """Decoys alternate between the room a prior points to and the start room."""
    return [first if i % 2 == 0 else second for i in range(count)]


def start_agent(world: World, rng: random.Random, *avoid: str) -> str:
    """Put the agent in a random room other than `avoid` (where the target is, so it must search)."""
    world.location = rng.choice([r for r in world.rooms if r not in avoid])
    return world.location
