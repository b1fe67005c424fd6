"""Text environments behind one surface: `make_env(name, **kwargs)`."""

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
import empo2.envs.minisci  # noqa: E402,F401  registers "minisci"
