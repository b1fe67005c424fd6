"""The ScienceWorld adapter on the real simulator (a JVM per env; one shared where possible)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from empo2.envs import make_env
from empo2.envs.base import SPLITS
from empo2.envs.pool import EnvPool
from empo2.envs.scienceworld import (
    DEFAULT_OOD_TASKS,
    ENV_STEP_LIMIT,
    NO_MATCH,
    TASK_BUDGETS,
    TASKS,
    ScienceWorldTextEnv,
)
from empo2.envs.scienceworld_tasks import catalogue, catalogue_cache_path
from tests.real_parts import require

GOLD_PATHS = Path(__file__).parents[2] / "reports" / "scienceworld_gold_paths" / "scienceworld_gold_paths.json"
needs_java = pytest.mark.needs("scienceworld", "java")


@pytest.fixture(scope="module")
def env():
    require("scienceworld", "java")
    e = make_env("scienceworld", reward_scale=0.01)  # rewards in [0, 1]: the sums below are fractions
    yield e
    e.close()


def replay(env, actions):
    """Step through `actions`; "0" entries of a gold path answer an ambiguity prompt, which the
    adapter already answers itself, so they are skipped."""
    results = []
    for a in actions:
        if a == "0":
            continue
        results.append(env.step(a))
        if results[-1].done:
            break
    return results


def wait_until_dead(env, timeout=10.0):
    """SIGKILL is asynchronous: wait until the env sees its JVM gone."""
    deadline = time.monotonic() + timeout
    while env.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not env.alive()


# ------------------------------------------------------------------ no JVM needed
def test_import_is_lazy_and_registers_scienceworld():
    code = ("import sys, empo2.envs as e; assert 'scienceworld' in e.registered_envs(); "
            "bad = [m for m in ('scienceworld', 'py4j') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_bad_arguments_are_rejected_before_a_jvm_starts():
    with pytest.raises(ValueError, match="teleportAction"):
        make_env("scienceworld", simplification="hard")
    with pytest.raises(ValueError, match="max_steps"):
        make_env("scienceworld", max_steps=0)
    with pytest.raises(ValueError, match="known tasks"):
        make_env("scienceworld", task="boil-water")


def test_budget_table_covers_every_task():
    assert len(TASKS) == 30 and TASK_BUDGETS["power-component"] == 30
    assert set(DEFAULT_OOD_TASKS) <= set(TASKS)


def test_budgets_cover_the_measured_gold_paths():
    """Every budget is at least the longest gold path benchmarks/scienceworld_gold_paths.py measured
    (every train variation and the first 20 test ones, in adapter steps)."""
    measured = json.loads(GOLD_PATHS.read_text())
    assert measured["simplification"] == "easy" and measured["variations"] == {"train": "all", "test": "first 20"}
    assert set(measured["tasks"]) == set(TASKS)
    short = {t: (TASK_BUDGETS[t], m["max"]) for t, m in measured["tasks"].items() if TASK_BUDGETS[t] < m["max"]}
    assert not short, f"budget < longest gold path: {short}"


# ------------------------------------------------------------------ shared JVM
@pytest.mark.parametrize("task,variation", [
    ("find-living-thing", 0), ("lifespan-longest-lived", 3), ("power-component", 1),
    ("use-thermometer", 2), ("grow-plant", 0),
])
def test_gold_path_reaches_100(env, task, variation):
    gold = env.gold_actions(task, variation)
    obs, info = env.reset(task, variation)
    results = replay(env, gold)
    assert "called the" in obs and info["task"] == task and info["variation"] == variation
    last = results[-1]
    assert last.done and last.info["won"] and last.info["score"] == 100 and not last.info["truncated"]
    assert not any(r.info["invalid_action"] or r.info["corrected"] for r in results)
    assert all(r.info["action"] == r.info["parsed_action"] for r in results)
    # Rewards are score deltas from 0, scaled by 0.01: they sum to the final score / 100.
    assert sum(r.reward for r in results) == pytest.approx(1.0)
    assert [r.info["steps"] for r in results] == list(range(1, len(results) + 1))
    if task == "grow-plant":  # its gold path answers an ambiguity prompt with "0"
        assert any(r.info["ambiguous"] for r in results)


# find-animal: its first test variation's gold path (16 steps) was once cut off by a budget of 15;
# inclined-plane-friction-unnamed-surfaces: 191 steps, past the released env step limit (100);
# test-conductivity: an electrical task; boil: a long gold path (~100 steps).
@pytest.mark.parametrize("task", ["find-animal", "inclined-plane-friction-unnamed-surfaces", "test-conductivity",
                                  "boil"])
def test_default_budget_covers_the_gold_path(env, task):
    variation = catalogue().split(task, "test")[0]
    gold = env.gold_actions(task, variation)
    _, info = env.reset(task, variation)
    results = replay(env, gold)
    assert info["max_steps"] == TASK_BUDGETS[task] >= len(results)
    last = results[-1]
    assert last.done and last.info["won"] and last.info["score"] == 100 and not last.info["truncated"]


def test_garbage_input_is_invalid_and_changes_nothing(env):
    env.reset("find-living-thing", 0)
    key, valid = env.state_key(), env.valid_actions()
    garbage = ["", "   \n\n", "\x00\x07\x1b[31m", "🤖" * 500, "z" * 10_000, "<|im_end|>", "Action: ''",
               None, 42]
    results = [env.step(g) for g in garbage]
    for r in results:
        assert r.obs == NO_MATCH and not r.done
        assert r.info["invalid_action"] and not r.info["corrected"] and r.info["action"] is None
    assert env.state_key() == key and env.valid_actions() == valid
    assert results[-1].info["steps"] == len(garbage)
    # Nothing ran, so the summed reward is just the score the task grants at the start.
    assert sum(r.reward for r in results) == pytest.approx(results[-1].info["score"] / 100)


def test_unrecognised_action_with_and_without_correction(env):
    env.reset("find-living-thing", 0)
    key = env.state_key()
    env.action_correction = False
    try:
        r = env.step("Action: travel to the kitchen now")
    finally:
        env.action_correction = True
    assert r.info["invalid_action"] and not r.info["corrected"] and r.obs == NO_MATCH
    assert env.state_key() == key

    valid = env.valid_actions()
    r = env.step("Action: travel to the kitchen now")
    assert r.info["corrected"] and not r.info["invalid_action"]
    assert r.info["parsed_action"] == "travel to the kitchen now" and r.info["action"] in valid
    assert env.state_key() != key
    r = env.step('"look around"\nI will now look.')  # exact valid action: taken as is
    assert r.info["action"] == "look around" and not r.info["corrected"]


def test_ambiguous_input_is_answered_with_the_first_reading(env):
    env.reset("find-living-thing", 0)
    r = env.step("open door")
    assert r.info["ambiguous"] and r.info["action"] == "open door"
    assert not r.obs.startswith("Ambiguous")
    # The simulator is not left waiting for a number: the valid actions are actions again.
    assert "look around" in env.valid_actions()


def test_wrong_focus_ends_the_episode_at_zero(env):
    env.reset("find-living-thing", 0)
    results = [env.step("go to kitchen"), env.step("focus on chair")]
    last = results[-1]
    assert last.done and last.info["task_failed"] and not last.info["won"] and last.info["score"] == 0
    assert results[0].info["score"] > 0 and last.reward < 0
    assert sum(r.reward for r in results) == pytest.approx(0.0)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look around")


@needs_java
def test_unclamped_wrong_focus_ends_at_minus_100():
    """env.clamp_score=False (released code): the simulator's -100 is the score and the summed reward."""
    e = make_env("scienceworld", clamp_score=False, reward_scale=1.0)
    try:
        e.reset("find-living-thing", 0)
        results = [e.step("go to kitchen"), e.step("focus on chair")]
        last = results[-1]
        assert last.done and last.info["task_failed"] and last.info["score"] == -100
        assert sum(r.reward for r in results) == pytest.approx(-100.0)
    finally:
        e.close()


def test_step_budget_truncates(env):
    env.max_steps = 3
    try:
        _, info = env.reset("find-living-thing", 0)
        results = [env.step("look around") for _ in range(3)]
    finally:
        env.max_steps = None
    assert info["max_steps"] == 3
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["truncated"] and not results[-1].info["won"]
    assert env.budget("power-component") == 30
    assert env.budget("measure-melting-point-known-substance") == ENV_STEP_LIMIT


def test_state_key_tracks_location_and_inventory(env):
    env.reset("find-living-thing", 0)
    start = env.state_key()
    env.step("look around")
    assert env.state_key() == start  # looking changes nothing
    env.step("go to kitchen")
    kitchen = env.state_key()
    env.step("pick up thermometer")
    holding = env.state_key()
    assert len({start, kitchen, holding}) == 3
    env.reset("find-living-thing", 0)
    assert env.state_key() == start
    env.reset("find-living-thing", 1)
    assert env.state_key() != start  # another task instance counts separately


def test_reset_rejects_bad_task_and_variation(env):
    with pytest.raises(ValueError, match="known tasks"):
        env.reset("boil-water", 0)
    with pytest.raises(ValueError, match="exceeds the total number of variations"):
        env.reset("power-component", 999)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look around")
    _, info = env.reset("power-component")  # no variation: a train variation drawn from `seed`
    assert info["variation"] in range(10)
    assert env.task_description.startswith("Your task is")


# ------------------------------------------------------------------ failures and restarts
@needs_java
def test_dead_or_hung_jvm_is_restarted_and_the_episode_reported_failed():
    with ScienceWorldTextEnv(call_timeout_s=2.0) as e:
        gold = e.gold_actions("find-living-thing", 0)
        e.reset("find-living-thing", 0)
        e.step(gold[0])
        first = e.jvm_pid
        os.kill(first, signal.SIGKILL)
        wait_until_dead(e)
        r = e.step(gold[1])
        assert r.done and "exited" in r.info["env_error"] and not r.info["won"]
        assert e.restarts == 1 == r.info["env_restarts"] and e.alive() and e.jvm_pid != first

        e.reset("find-living-thing", 0)
        hung = e.jvm_pid
        os.kill(hung, signal.SIGSTOP)  # a JVM that never answers
        t0 = time.monotonic()
        r = e.step(gold[0])
        assert time.monotonic() - t0 < 30
        assert r.done and "did not answer" in r.info["env_error"] and e.restarts == 2
        assert not os.path.exists(f"/proc/{hung}")  # killed and reaped

        e.reset("find-living-thing", 0)  # the replacement serves whole episodes again
        assert replay(e, gold)[-1].info["won"]
    assert e.jvm_pid is None and e.closed


@needs_java
def test_pool_reuses_started_envs_and_restarts_dead_ones():
    with EnvPool("scienceworld", max_idle=1) as pool:
        a = pool.acquire()
        pid = a.jvm_pid
        pool.release(a)
        assert pool.acquire() is a and a.jvm_pid == pid and pool.built == 1
        b = pool.acquire()  # none idle: a second JVM
        assert b is not a and pool.built == 2
        pool.release(a)
        pool.release(b)  # beyond max_idle: closed
        assert b.closed and b.jvm_pid is None and len(pool) == 1
        os.kill(pid, signal.SIGKILL)
        wait_until_dead(a)
        with pool.lease() as env:
            assert env is a and env.alive() and env.jvm_pid != pid and pool.restarted == 1
            env.reset("lifespan-longest-lived", 0)
            assert not env.step("look around").done
        with pytest.raises(ValueError, match="not acquired"):
            pool.release(b)
    assert a.closed and a.jvm_pid is None


# ------------------------------------------------------------------ catalogue
@needs_java
def test_catalogue_is_the_package_split_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path))
    cat = catalogue()
    path = catalogue_cache_path()
    assert path.parent == tmp_path and json.loads(path.read_text())["variations"] == cat.variations
    assert set(cat.variations) == set(TASKS) and cat.ood_tasks == list(DEFAULT_OOD_TASKS)
    assert set(cat.tasks()) == set(TASKS) - set(DEFAULT_OOD_TASKS)
    for task, splits in cat.variations.items():
        parts = [splits[s] for s in SPLITS]
        assert all(p == sorted(p) for p in parts) and parts[0] and parts[2], task
        assert len(set().union(*map(set, parts))) == sum(map(len, parts)), task
    # The package's 50/25/25 split by index (find-living-thing has 300 variations).
    assert cat.split("find-living-thing", "train") == list(range(150))
    assert cat.split("power-component", "test") == list(range(15, 20))

    # Later calls read the file and start no JVM.
    import empo2.envs.jvm as jvm

    def no_jvm(*args, **kwargs):
        raise AssertionError("catalogue() started a JVM despite the cache")

    monkeypatch.setattr(jvm, "Jvm", no_jvm)
    again = catalogue(ood_tasks=["boil"])
    assert again.variations == cat.variations and again.ood_tasks == ["boil"]
    with pytest.raises(ValueError, match="known tasks"):
        catalogue(ood_tasks=["boil-water"])


def test_collections_run_as_long_as_the_longest_budget_of_the_run():
    """Budgets above 100 steps take effect: the collector's step bound follows the run's tasks."""
    from empo2.config import load_config
    from empo2.envs import make_env
    from empo2.rollout.build import episode_step_bound

    env = make_env("scienceworld")  # no JVM until reset
    boil = load_config(["env=scienceworld", "env.tasks=[boil,find-animal]", "model=tiny"])
    assert episode_step_bound(boil, env) == env.budget("boil") > 100
    short = load_config(["env=scienceworld", "env.tasks=[find-animal]", "model=tiny"])
    assert episode_step_bound(short, env) == 100
    fixed = load_config(["env=scienceworld", "env.tasks=[boil]", "env.max_steps=7", "model=tiny"])
    assert episode_step_bound(fixed, env) == 7
    env.close()


@needs_java
def test_a_runs_environments_start_side_by_side_and_a_failed_start_leaves_no_jvm_behind(monkeypatch):
    """`start_envs`: one live JVM per environment; where one environment fails to start, those that started are
    closed before the error reaches the caller."""
    import empo2.rollout.build as build
    from empo2.config import load_config

    cfg = load_config(["env=scienceworld", "model=tiny"])
    envs = build.start_envs(cfg, 3)
    try:
        assert len({e.jvm_pid for e in envs}) == 3 and all(e.alive() for e in envs)
        envs[2].reset("lifespan-longest-lived", 0)
        assert not envs[2].step("look around").done
    finally:
        for e in envs:
            e.close()

    started, calls = [], []

    def second_fails(name, **kwargs):
        calls.append(name)
        if len(calls) == 2:
            raise RuntimeError("no JVM for this one")
        started.append(make_env(name, **kwargs))
        return started[-1]

    monkeypatch.setattr(build, "make_env", second_fails)
    with pytest.raises(RuntimeError, match="no JVM for this one"):
        build.start_envs(cfg, 3)
    assert len(started) == 2 and all(e.closed and e.jvm_pid is None for e in started)
