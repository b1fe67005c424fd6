"""MiniSci: an embedded, pure-Python, ScienceWorld-like text lab built around one exploration trap.

The instruction names something that is not where a prior-driven agent looks, and a look-alike
sits where it does look; focusing on the wrong thing ends the episode at score 0. Five families
(find-living-thing, power-component, measure-temperature, mix-paint and the held-out change-state),
300 variations each, partial-progress scores 0-100, a gold path per instance, and steps cheap
enough that the policy, not the environment, sets a run's pace (docs/performance.md).

    env = make_env("minisci")
    obs, info = env.reset(task="power-component", variation=3)
    result = env.step("go to workshop")

The subpackage owns the lab: its world and commands, the house layouts, the task families and their catalogue.
It registers itself through `empo2.envs.base` (the protocol and registry), its one import outside itself, and
imports no other environment. Like the rest of `empo2.envs` it may import `empo2.config`, `empo2.algo` and
`empo2.utils` (the layers contract in pyproject.toml), not `empo2.memory` (its peer) nor anything above.
"""

from empo2.envs.minisci.env import NUM_VARIATIONS, MiniSciEnv, catalogue, gold_actions
from empo2.envs.minisci.families import FAMILIES, OOD_FAMILIES
from empo2.envs.minisci.layout import Difficulty

__all__ = [
    "FAMILIES",
    "NUM_VARIATIONS",
    "OOD_FAMILIES",
    "Difficulty",
    "MiniSciEnv",
    "catalogue",
    "gold_actions",
]
