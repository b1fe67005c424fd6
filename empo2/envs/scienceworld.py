"""ScienceWorld (the `scienceworld` package: a Scala simulator behind py4j) as a `TextEnv`.

`make_env("scienceworld", simplification="easy", max_steps=None, action_correction=True,
reward_scale=1.0, call_timeout_s=10.0, jar_path=None, seed=None, task=None)`.

Fast path. The package's `ScienceWorldEnv.step` recomputes the full valid-action list (plus look,
inventory and task description) after every action, several times the cost of the action itself
(`benchmarks/scienceworld_step.py`; docs/performance.md, "Costs behind the code"). This adapter calls the
simulator's `step`, `getScore` and `getCompleted` directly and
builds the valid list only when asked: by `valid_actions()`, or by action correction when the
simulator did not recognise the input. The simulator's parser answers unrecognised input with
`NO_MATCH` and then does nothing (no tick, no state change), so "try first, correct on NO_MATCH"
leaves the world exactly as "correct first" would, and a recognised action is never second-guessed.

Differences from the released EMPO² code (which always picks the valid action of highest Jaccard
overlap, even for input the simulator understands): input the simulator parses is taken as typed
(e.g. "pick up the thermometer"); an input matching several objects ("open door" in the hallway)
gets the simulator's ambiguity prompt answered with "0", its first reading, in the same step
(the released code spends the next step on it: its Jaccard rule maps that step's output onto the
choices "0", "1", ..., which gives "0" unless the model typed a number); input with no word in
common with any valid action stays invalid instead of becoming the first valid action.

Scores. The simulator's score is in [0, 1] (-1 after a wrong "focus on", which ends the episode);
`info["score"]` is round(100 * score) clamped at 0. The reward is the change of that clamped score
times `reward_scale`, counted from 0 at reset, so an episode's rewards sum to
final_score * reward_scale (score points by default, as `env.reward_scale`) even when a task grants points at the
start.
"""

from __future__ import annotations

import random
from typing import Any

from empo2.envs.actions import resolve_action
from empo2.envs.base import StepResult, register_env, stable_hash
from empo2.envs.jvm import Jvm, JvmError
from empo2.envs.scienceworld_tasks import (
    DEFAULT_OOD_TASKS,
    ELECTRICAL_TASKS,
    ENV_STEP_LIMIT,
    SIMPLIFICATIONS,
    TASK_BUDGETS,
    TASKS,
    catalogue,
    check_simplification,
    check_task,
)

__all__ = [
    "DEFAULT_OOD_TASKS", "ENV_STEP_LIMIT", "SIMPLIFICATIONS", "TASK_BUDGETS", "TASKS", "EnvError",
    "ScienceWorldTextEnv", "catalogue",
]

NO_MATCH = "No known action matches that input."
AMBIGUOUS_PREFIX = "Ambiguous request"
# Console commands the simulator answers without acting (help text, object list, task text); they
# are not actions, so they are treated like unrecognised input.
_META_INPUTS = frozenset({"help", "objects", "task"})
# A load builds the whole world (and a gold path when asked): seconds on an idle core, many times the step timeout.
_LOAD_TIMEOUT_FACTOR = 6.0


class EnvError(RuntimeError):
    """The simulator could not be (re)started or failed twice in a row while loading a task."""


@register_env("scienceworld")
class ScienceWorldTextEnv:
    """One ScienceWorld simulator (one JVM, started here) serving one episode at a time.

    Args:
        simplification: "easy" (default, as in the released code), "" or a comma-separated subset
            of `SIMPLIFICATIONS`.
        max_steps: step budget for every task; None uses the per-task `TASK_BUDGETS` (never shorter
            than the package's gold path). An episode that reaches it ends with `info["truncated"] = True`.
        action_correction: replace input the simulator does not recognise by the valid action of
            highest word-level Jaccard overlap (the released code's rule); off: it is an invalid
            action that leaves the state unchanged.
        reward_scale: reward = change of the clamped 0-100 score times this.
        clamp_score: clamp the score at 0 (default); False keeps the simulator's -100 after a wrong
            "focus on", as the released code does, so the rewards then sum to -100 * reward_scale.
        call_timeout_s: deadline of every call into the JVM (loads get 6x); past it the JVM is
            killed and restarted and the episode ends with `info["env_error"]`.
        jar_path: simulator jar; None uses the one bundled with the package.
        seed: seeds the draw of a train variation when `reset` gets no variation.
        task: task used when `reset` gets none.
    """

    def __init__(self, simplification: str = "easy", max_steps: int | None = None,
                 action_correction: bool = True, reward_scale: float = 1.0, call_timeout_s: float = 10.0,
                 jar_path: str | None = None, seed: int | None = None, task: str | None = None,
                 clamp_score: bool = True) -> None:
        self.simplification = check_simplification(simplification)
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        if call_timeout_s <= 0:
            raise ValueError(f"call_timeout_s must be > 0, got {call_timeout_s}")
        self.max_steps = max_steps
        self.action_correction = bool(action_correction)
        self.reward_scale = float(reward_scale)
        self.clamp_score = bool(clamp_score)
        self.call_timeout_s = float(call_timeout_s)
        self.jar_path = jar_path
        self.default_task = check_task(task) if task is not None else None
        self.restarts = 0  # JVMs started to replace a failed one, over this object's life
        self.task_description = ""
        self.task: str | None = None
        self.variation: int | None = None
        self._rng = random.Random(seed)
        self._train_variations: dict[str, list[int]] = {}
        self._jvm: Jvm | None = None
        self._jvm_started = False
        self._closed = False
        self._in_episode = False
        self._done = True
        self._pending_error: str | None = None
        self._steps = self._score = self._raw_score = self._initial_score = self._budget = 0
        self._reset_caches()
        try:
            self._start_jvm()
        except JvmError as err:
            raise EnvError(f"could not start ScienceWorld's JVM (it needs `java` 17 on PATH): {err}") from err

    # ----------------------------------------------------------------- lifecycle
    def alive(self) -> bool:
        """Whether the JVM is running (a dead one is replaced by the next `reset` or `restart`)."""
        return self._jvm is not None and self._jvm.alive()

    @property
    def jvm_pid(self) -> int | None:
        return None if self._jvm is None else self._jvm.pid

    def restart(self) -> None:
        """Kill the JVM (if any) and start a fresh one; the current episode is over."""
        self._ensure_open()
        self._in_episode, self._done = False, True
        self._replace_jvm()

    def close(self) -> None:
        """Kill the JVM. Idempotent."""
        self._closed = True
        self._in_episode, self._done = False, True
        self._drop_jvm()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> ScienceWorldTextEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------- episode
    def budget(self, task: str) -> int:
        """Step budget of `task` under this env's `max_steps`."""
        if self.max_steps is not None:
            return self.max_steps
        return TASK_BUDGETS[check_task(task)]

    def reset(self, task: str | None = None, variation: int | None = None) -> tuple[str, dict[str, Any]]:
        """Load `task` (default: the constructor's `task`) at `variation` (default: a train variation
        drawn with `seed`) and return the first observation (the simulator's "look around")."""
        self._ensure_open()
        task = check_task(task if task is not None else self._require_default_task())
        if any(k in task for k in ELECTRICAL_TASKS) and "noElectricalAction" in self.simplification:
            raise ValueError(f"task {task!r} needs electrical actions; drop noElectricalAction")
        if variation is not None and (not isinstance(variation, int) or variation < 0):
            raise ValueError(f"variation must be a non-negative int or None, got {variation!r}")
        self._in_episode, self._done = False, True
        last: JvmError | None = None
        for _ in range(2):  # a failed JVM gets one fresh replacement before giving up
            try:
                if self._jvm is None:
                    self._start_jvm()
                if variation is None:
                    variation = self._rng.choice(self._train_variations_of(task))
                obs = self._load(task, variation)
                break
            except JvmError as err:
                last = err
                self._drop_jvm()
        else:
            raise EnvError(f"ScienceWorld failed twice loading {task!r} variation {variation}: {last}")
        self.task, self.variation = task, variation
        self._steps, self._score, self._budget = 0, 0, self.budget(task)
        self._pending_error = None
        self._in_episode, self._done = True, False
        return obs, {"task": task, "variation": variation, "max_steps": self._budget,
                     "score": self._initial_score, "won": False, "steps": 0, "env_restarts": self.restarts}

    def step(self, action_text: str) -> StepResult:
        """Take one step from raw model text. Never raises on model output; a JVM failure ends the
        episode with `info["env_error"]` (the JVM is restarted for the next episode)."""
        if not self._in_episode:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode is over; call reset()")
        self._steps += 1
        action, info = resolve_action(action_text, None, self.action_correction)
        info["ambiguous"] = False
        if self._pending_error is not None:
            return self._failed_step(self._pending_error, info)
        try:
            obs, action = self._act(action, action_text, info)
            if action is None:  # nothing ran, nothing changed
                raw, completed = self._raw_score, False
            else:
                raw = round(100 * self._call("getScore"))
                completed = bool(self._call("getCompleted"))
        except JvmError as err:
            return self._failed_step(str(err), info)
        if action is not None:
            self._reset_caches()
            self._raw_score = raw
        score = max(raw, 0) if self.clamp_score else raw
        reward = (score - self._score) * self.reward_scale
        self._score = score
        failed = raw < 0  # a wrong "focus on": the simulator's score is -1 and nothing can fix it
        done = completed or failed
        truncated = not done and self._steps >= self._budget
        self._done = done or truncated
        info.update(action=action, score=score, won=bool(completed and raw >= 100), task_failed=failed,
                    steps=self._steps, truncated=truncated, env_restarts=self.restarts)
        return StepResult(obs=obs, reward=reward, done=self._done, info=info)

    def valid_actions(self) -> list[str]:
        """Valid action strings of the current state (sorted; computed on request, then cached until
        the state changes). Empty when the JVM failed; the next `step` reports that failure."""
        if self._valid is None:
            try:
                self._valid = [str(a) for a in self._call("getValidActionObjectCombinations")]
            except JvmError as err:
                self._pending_error = self._pending_error or str(err)
                return []
        return list(self._valid)

    def state_key(self) -> str:
        """Stable hash of (task, variation, look-around text, inventory): the novelty state.

        Both texts come from the simulator's free actions (they take no time). Task and variation are
        part of the key so that identical rooms of different task instances count separately.
        """
        if self._key is None:
            try:
                look, inv = str(self._call("freeActionLook")), str(self._call("freeActionInventory"))
            except JvmError as err:
                self._pending_error = self._pending_error or str(err)
                return stable_hash("scienceworld", "env_error", str(self.task), str(self.variation))
            self._key = stable_hash("scienceworld", str(self.task), str(self.variation), look, inv)
        return self._key

    def gold_actions(self, task: str, variation: int) -> list[str]:
        """The package's gold action sequence for a task instance (used to validate the adapter).
        Ends the current episode: call `reset` afterwards."""
        self._ensure_open()
        check_task(task)
        self._in_episode, self._done = False, True
        try:
            if self._jvm is None:
                self._start_jvm()
            err = self._call("load", task, variation, self.simplification, True, timeout=self._load_timeout)
            if err:
                raise ValueError(str(err))
            return [str(a) for a in self._call("getGoldActionSequence")]
        except JvmError as err:
            self._drop_jvm()
            raise EnvError(f"ScienceWorld failed computing the gold path of {task!r}: {err}") from err

    # ----------------------------------------------------------------- internals
    @property
    def _load_timeout(self) -> float:
        return self.call_timeout_s * _LOAD_TIMEOUT_FACTOR

    def _act(self, action: str | None, action_text: str, info: dict) -> tuple[str, str | None]:
        """Run the action (correcting it when the simulator does not recognise it); returns the
        observation and the action that ran (None: nothing ran)."""
        obs = NO_MATCH
        if action is not None and action not in _META_INPUTS:
            obs = str(self._call("step", action))
        if obs == NO_MATCH:
            action = None
            if self.action_correction and info["parsed_action"]:
                fixed, fix_info = resolve_action(action_text, self.valid_actions(), True)
                if self._pending_error is not None:
                    raise JvmError(self._pending_error)
                info.update(fix_info)
                if fixed is not None:
                    obs = str(self._call("step", fixed))
                    action = None if obs == NO_MATCH else fixed
            info["invalid_action"] = action is None
        if action is not None and obs.startswith(AMBIGUOUS_PREFIX):
            obs = str(self._call("step", "0"))
            info["ambiguous"] = True
        return obs, action

    def _load(self, task: str, variation: int) -> str:
        err = self._call("load", task, variation, self.simplification, False, timeout=self._load_timeout)
        if err:  # e.g. a variation past the task's count; the simulator says which
            raise ValueError(str(err))
        obs = str(self._call("step", "look around"))
        self._raw_score = round(100 * self._call("getScore"))
        self._initial_score = max(self._raw_score, 0)
        self.task_description = str(self._call("getTaskDescription"))
        self._reset_caches()
        return obs

    def _train_variations_of(self, task: str) -> list[int]:
        if task not in self._train_variations:
            err = self._call("load", task, 0, "", False, timeout=self._load_timeout)
            if err:
                raise ValueError(str(err))
            self._train_variations[task] = sorted(int(v) for v in self._call("getVariationsTrain"))
        return self._train_variations[task]

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if self._jvm is None:
            raise JvmError("no running JVM")
        return self._jvm.call(method, *args, timeout=timeout)

    def _failed_step(self, error: str, info: dict) -> StepResult:
        """End the episode as failed and put a fresh JVM in place for the next one."""
        self._done = True
        self._pending_error = None
        try:
            self._replace_jvm()
        except JvmError as err:  # no JVM now; the next reset tries again and raises if it cannot
            error = f"{error}; restart failed: {err}"
        info.update(action=None, score=self._score, won=False, task_failed=False, steps=self._steps,
                    truncated=False, env_error=error, env_restarts=self.restarts)
        return StepResult(obs=f"The environment failed: {error}", reward=0.0, done=True, info=info)

    def _replace_jvm(self) -> None:
        self._drop_jvm()
        self._start_jvm()

    def _drop_jvm(self) -> None:
        if self._jvm is not None:
            self._jvm.close()
            self._jvm = None

    def _start_jvm(self) -> None:
        replacing = self._jvm_started
        self._jvm = Jvm(self.jar_path, self.call_timeout_s)
        self._jvm_started = True
        if replacing:
            self.restarts += 1

    def _reset_caches(self) -> None:
        self._valid: list[str] | None = None
        self._key: str | None = None

    def _require_default_task(self) -> str:
        if self.default_task is None:
            raise ValueError(f"reset() needs a task (none given at construction); known tasks: {list(TASKS)}")
        return self.default_task

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ScienceWorld env is closed")
