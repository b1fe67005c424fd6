"""Text environments behind one surface: `make_env(name, **kwargs)`.

Importing the environment modules registers them; heavy dependencies (the ScienceWorld JVM,
TextWorld) are imported only when an environment is built.
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
