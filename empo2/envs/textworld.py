"""Microsoft TextWorld (the optional `textworld` extra) as a `TextEnv`: generated games, played offline.

`make_env("textworld", max_steps=None, action_correction=True, reward_scale=1.0, seed=None, task=None,
generation_timeout_s=300.0)`; `reset(task="tw-coin_collector/5", variation=3)`. Tasks, levels, splits
and the game cache are described in `empo2.envs.textworld_games`; a game is generated on the first
reset of its variation, in any process, and read from the cache afterwards.

Actions. Only admissible commands (TextWorld's list for the current state) are sent to the game. The
game's parser accepts more ("get coin", "n"), but TextWorld's state tracker recognises only the
canonical forms: after "get chicken wing" the game has the wing in the inventory while the tracker
still sees it in the fridge, and every later admissible list and state key would be wrong. A command
outside the list is replaced by the admissible command of highest word-level Jaccard overlap when
`action_correction` is on (`empo2.envs.actions.resolve_action`, as the released EMPO² code does),
and is otherwise an invalid action: it costs a step and changes nothing.

Cost. The tracker (needed for the admissible list and the state key) costs about as much as the step itself
(docs/performance.md, "Costs behind the code"); the command strings are almost free on top. TextWorld's
`policy_commands` (a re-planned winning path, dearer than a tracked step and growing with the game) is never
requested: the walkthrough comes from the game file, checked and stored when the game is generated
(`gold_actions()`).

Scores. `info["score"]` is 100 * game score / max score, in [0, 100]; the reward is its change times
`reward_scale`, so an episode's rewards sum to final_score * reward_scale. `won` and `lost` are the
game's ("*** The End ***" / "*** You lost! ***"); either ends the episode.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from empo2.envs.actions import resolve_action
from empo2.envs.base import StepResult, register_env, stable_hash
from empo2.envs.textworld_games import (
    DEFAULT_OOD_TASKS,
    META_FILE,
    NUM_VARIATIONS,
    TASKS,
    GenerationError,
    GenerationTimeout,
    catalogue,
    check_task,
    ensure_game,
    game_seed,
)

__all__ = ["DEFAULT_OOD_TASKS", "TASKS", "GenerationError", "GenerationTimeout", "TextWorldEnv", "catalogue"]

INVALID_OBS = "That command is not available here."
# Step budget: 50, or twice the walkthrough when that is longer (long coin chains, big recipes).
# This project's choice; `max_steps` overrides it.
BASE_BUDGET = 50
# Inform's prompt and, on the same line, the status bar ("-= Kitchen =-0/4": room, score/moves): not
# part of what the game says.
_PROMPT_TAIL = re.compile(r"\n>[^\n]*\Z")
_END_PROMPT = "Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?"
# The ASCII-art title printed before the objective at the start of every game.
_BANNER_LINE = re.compile(r"^[\s_|\\$/<>]*$")


def _require_textworld() -> None:
    try:
        import textworld  # noqa: F401
    except ImportError as err:
        raise ImportError("the textworld environment needs the optional TextWorld package: "
                          "pip install -e .[textworld]") from err


def clean_feedback(text: str, objective: str = "") -> str:
    """The game's text without prompt, status bar, restart question, title art or (when given) the
    objective, which the task description already carries."""
    text = _PROMPT_TAIL.sub("", text).replace(_END_PROMPT, "")
    lines = text.split("\n")
    while lines and _BANNER_LINE.match(lines[0]):
        lines.pop(0)
    text = "\n".join(line.strip() for line in lines).strip()
    if objective and text.startswith(objective):
        text = text[len(objective):]
    return re.sub(r"\n{3,}", "\n\n", text).strip()


@register_env("textworld")
class TextWorldEnv:
    """One TextWorld game at a time (a Z-machine inside this process, through jericho).

    Args:
        max_steps: step budget of every episode (invalid steps included); None: 50, or twice the
            game's walkthrough when longer. Reaching it ends the episode with `info["truncated"]`.
        action_correction: replace a command that is not admissible by the admissible command of
            highest word-level Jaccard overlap; off: it is an invalid action that changes nothing.
        reward_scale: reward = change of the 0-100 score times this.
        seed: seeds the draw of a train variation when `reset` gets no variation.
        task: task used when `reset` gets none (later resets default to the previous task).
        generation_timeout_s: limit on generating a game not yet cached (waiting for another process
            generating the same game included); past it `reset` raises GenerationTimeout.
    """

    def __init__(self, max_steps: int | None = None, action_correction: bool = True, reward_scale: float = 1.0,
                 seed: int | None = None, task: str | None = None, generation_timeout_s: float = 300.0) -> None:
        _require_textworld()
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        if not generation_timeout_s > 0:
            raise ValueError(f"generation_timeout_s must be > 0, got {generation_timeout_s!r}")
        if task is not None:
            check_task(task)
        self.max_steps = max_steps
        self.action_correction = bool(action_correction)
        self.reward_scale = float(reward_scale)
        self.generation_timeout_s = float(generation_timeout_s)
        self.task: str | None = task
        self.variation: int | None = None
        self.task_description = ""
        self._rng = random.Random(seed)
        self._catalogue = catalogue()
        self._game: Any = None  # the running textworld environment
        self._game_path: Path | None = None
        self._state: Any = None  # textworld's GameState after the last command
        self._walkthrough: list[str] = []
        self._valid: list[str] | None = None
        self._steps = self._budget = 0
        self._score = 0.0
        self._done = True
        self._closed = False

    # ------------------------------------------------------------------------- episode
    def reset(self, task: str | None = None, variation: int | None = None) -> tuple[str, dict[str, Any]]:
        """Start (task, variation), generating its game first when it is not cached. `task` defaults
        to the previous one, then the constructor's; `variation` to a train variation drawn with
        `seed` (any non-negative int is a valid game; the catalogue splits use 0-199)."""
        if self._closed:
            raise RuntimeError("this TextWorld env is closed")
        task = task if task is not None else self.task
        if task is None:
            raise ValueError(f"reset() needs a task (none given before); catalogue tasks: {list(TASKS)}")
        check_task(task)
        if variation is None:
            pool = self._catalogue.variations[task]["train"] if task in TASKS else range(NUM_VARIATIONS)
            variation = self._rng.choice(pool)
        if isinstance(variation, bool) or not isinstance(variation, int) or variation < 0:
            raise ValueError(f"variation must be a non-negative int or None, got {variation!r}")
        path = ensure_game(task, variation, self.generation_timeout_s)
        if path != self._game_path:
            self._start(path)
        self._state = self._game.reset()
        self.task, self.variation = task, variation
        self.task_description = self._state["objective"]
        self._walkthrough = json.loads((path.parent / META_FILE).read_text())["walkthrough"]
        self._budget = self.max_steps or max(BASE_BUDGET, 2 * len(self._walkthrough))
        self._valid, self._steps, self._score, self._done = None, 0, 0.0, False
        obs = clean_feedback(self._state["feedback"], self.task_description)
        return obs, {"task": task, "variation": variation, "seed": game_seed(task, variation), "score": 0.0,
                     "won": False, "lost": False, "steps": 0, "max_steps": self._budget, "game_file": str(path)}

    def step(self, action_text: str) -> StepResult:
        """One step from raw model text; never raises on model output."""
        if self._state is None or self._closed:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode is over; call reset()")
        self._steps += 1
        action, info = resolve_action(action_text, self.valid_actions(), self.action_correction)
        won = lost = False
        if action is None:
            obs = INVALID_OBS
        else:
            self._state, _, _ = self._game.step(action)
            self._valid = None
            won, lost = bool(self._state["won"]), bool(self._state["lost"])
            obs = clean_feedback(self._state["feedback"])
        score = self._normalised_score()
        reward = (score - self._score) * self.reward_scale
        self._score = score
        truncated = not (won or lost) and self._steps >= self._budget
        self._done = won or lost or truncated
        info.update(action=action, score=score, won=won, lost=lost, steps=self._steps, truncated=truncated)
        return StepResult(obs=obs, reward=reward, done=self._done, info=info)

    def valid_actions(self) -> list[str]:
        """TextWorld's admissible commands of the current state (sorted, lower case)."""
        if self._state is None:
            raise RuntimeError("call reset() before valid_actions()")
        if self._valid is None:
            # Lower case because parsed model actions are: Inform's parser ignores case.
            self._valid = sorted({c.lower() for c in self._state["admissible_commands"]})
        return list(self._valid)

    def state_key(self) -> str:
        """Stable hash of (task, variation, room, inventory) from the game's logic state, so the
        novelty count grows with rooms visited and objects carried, not with re-worded text."""
        if self._state is None:
            raise RuntimeError("call reset() before state_key()")
        room, carried = "", []
        for fact in self._state["_facts"]:
            if fact.name == "at" and fact.arguments[0].type == "P":
                room = fact.arguments[1].name
            elif fact.name == "in" and fact.arguments[1].type == "I":
                carried.append(fact.arguments[0].name)
        return stable_hash("textworld", str(self.task), str(self.variation), room, *sorted(carried))

    def gold_actions(self) -> list[str]:
        """The current game's walkthrough (from its game file, as admissible commands; see
        `textworld_games.admissible_walkthrough`): wins from the initial state."""
        if self._state is None:
            raise RuntimeError("call reset() before gold_actions()")
        return list(self._walkthrough)

    def close(self) -> None:
        """Stop the game. Idempotent."""
        self._closed, self._done = True, True
        if self._game is not None:
            self._game.close()
        self._game = self._game_path = self._state = None

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TextWorldEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------- internals
    def _start(self, path: Path) -> None:
        import warnings

        import jericho
        import textworld

        if self._game is not None:
            self._game.close()
        infos = textworld.EnvInfos(score=True, max_score=True, won=True, lost=True, objective=True,
                                   admissible_commands=True)
        with warnings.catch_warnings():
            # jericho's own score and move detection covers a fixed list of commercial games; for
            # TextWorld games both come from TextWorld's wrappers, so its warning says nothing here.
            warnings.simplefilter("ignore", jericho.UnsupportedGameWarning)
            self._game = textworld.start(str(path), request_infos=infos)
        self._game_path = path

    def _normalised_score(self) -> float:
        max_score = self._state["max_score"]
        if not max_score:
            return 100.0 if self._state["won"] else 0.0
        return min(max(100.0 * self._state["score"] / max_score, 0.0), 100.0)
