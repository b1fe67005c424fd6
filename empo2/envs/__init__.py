"""Text environments behind one surface: `make_env(name, **kwargs)`.

Importing the environment modules registers them; heavy dependencies (the ScienceWorld JVM,
TextWorld) are imported only when an environment is built. The package owns the `TextEnv` protocol and registry,
ScienceWorld (its JVM and pool), TextWorld and the embedded MiniSci lab. May import `empo2.config`, `empo2.utils`
and `empo2.algo`; nothing above them (memory, models, rollout, lit, workflows) imports into it.
"""

from empo2.envs import minisci, scienceworld, textworld  # noqa: F401  (each registers itself)
from empo2.envs.base import (
    Catalogue,
    StepResult,
    TaskSpec,
    TextEnv,
    get_catalogue,
    make_env,
    register_env,
    registered_envs,
)

__all__ = [
    "Catalogue",
    "StepResult",
    "TaskSpec",
    "TextEnv",
    "get_catalogue",
    "make_env",
    "register_env",
    "registered_envs",
]
