"""MiniSci: the embedded ScienceWorld-like lab. Gold paths win every test variation, a uniformly
random policy falls into the focus trap, splits are stable across processes, and no model output
can crash a step."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys

import pytest

from empo2.envs import TextEnv, get_catalogue, make_env
from empo2.envs.minisci import FAMILIES, NUM_VARIATIONS, OOD_FAMILIES, catalogue, gold_actions
from empo2.envs.minisci.search_families import FIND_CATEGORIES
from empo2.envs.minisci.world import INVENTORY, Thing, World

HARD = dict(num_rooms=9, num_distractors=4, num_decoys=4, closed_doors=True, hide_prob=1.0)
INFO_KEYS = {"score", "won", "invalid_action", "corrected", "parsed_action", "steps", "truncated"}
RANDOM_SCORE_CEILING = 10.0  # mean score of a uniformly random policy over valid actions, per family


def run_gold(env, family: str, variation: int) -> list:
    env.reset(task=family, variation=variation)
    return [env.step(action) for action in env.gold_actions()]


def random_episode(env, family: str, variation: int, rng: random.Random):
    env.reset(task=family, variation=variation)
    while True:
        result = env.step(rng.choice(env.valid_actions()))
        if result.done:
            return result


# ----- surface ---------------------------------------------------------------------------------
def test_registered_with_the_shared_surface():
    env = make_env("minisci")
    assert isinstance(env, TextEnv)
    obs, info = env.reset(task="power-component", variation=3)
    assert obs.startswith("This room is called the ") and "You also see:\n\tA door to the " in obs
    assert info["task_description"] == env.task_description and "turn on the" in env.task_description
    assert INFO_KEYS <= set(info) and info["score"] == 0
    assert get_catalogue("minisci").variations == catalogue().variations
    env.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gold_reaches_100_on_every_test_variation(family):
    for kwargs in ({}, HARD):
        env = make_env("minisci", action_correction=False, **kwargs)
        for variation in catalogue().split(family, "test"):
            results = run_gold(env, family, variation)
            scores = [r.info["score"] for r in results]
            assert not any(r.info["invalid_action"] for r in results), (variation, kwargs)
            assert results[-1].done and results[-1].info["won"] and scores[-1] == 100, (variation, kwargs)
            assert not any(r.done for r in results[:-1])
            assert scores == sorted(scores) and len(results) < env.max_steps


def test_gold_paths_are_short_and_scores_partial():
    """The default gold paths stay short (4-13 steps), and every family passes intermediate
    milestones on the way to 100, so the score carries partial credit."""
    env = make_env("minisci")
    for family in FAMILIES:
        lengths, partial = [], set()
        for variation in catalogue().split(family, "test"):
            results = run_gold(env, family, variation)
            lengths.append(len(results))
            partial |= {r.info["score"] for r in results} - {0, 100}
        assert 3 <= min(lengths) and max(lengths) <= 16 and sum(lengths) / len(lengths) <= 11, family
        assert len(partial) >= 2, family


def test_random_policy_falls_into_the_trap():
    env = make_env("minisci")
    rng = random.Random(0)
    for family in FAMILIES:
        results = [random_episode(env, family, v, rng) for v in catalogue().split(family, "test")]
        mean = sum(r.info["score"] for r in results) / len(results)
        assert mean < RANDOM_SCORE_CEILING, (family, mean)
        # The trap, not the step budget, is what ends most random episodes.
        assert sum(r.info["failed"] for r in results) > 0.8 * len(results), family


def test_wrong_focus_ends_the_episode_at_zero():
    env = make_env("minisci", reward_scale=0.01)
    for family in FAMILIES:
        env.reset(task=family, variation=0)
        gold = env.gold_actions()
        for action in gold[:-1]:
            before = env.step(action)
        wrong = next(
            a
            for a in env.valid_actions()
            if a.startswith("focus on ") and a != gold[-1] and a[9:] not in env._world.focused
        )
        result = env.step(wrong)
        assert result.done and result.info["failed"] and not result.info["won"], family
        assert result.info["score"] == 0 and result.reward == pytest.approx(-before.info["score"] / 100)


def test_find_target_is_never_where_the_prior_looks():
    """The look-alikes sit in the start room and the room a prior points to; the target never does."""
    env = make_env("minisci")
    for variation in catalogue().split("find-living-thing", "test"):
        env.reset(task="find-living-thing", variation=variation)
        world, task = env._world, env._task
        assert world.room_of(task.target) not in (world.location, task.obvious_room)
        tempting = {n for _, _, decoys in FIND_CATEGORIES.values() for n in decoys} & set(world.things)
        tempting.discard(task.target)
        assert {world.room_of(name) for name in tempting} == {task.obvious_room, world.location}
        result = env.step(
            f"focus on {sorted(tempting)[0]}"
            if world.location == task.obvious_room
            else f"focus on {next(n for n in tempting if world.room_of(n) == world.location)}"
        )
        assert result.done and result.info["failed"] and result.info["score"] == 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_records_its_look_alikes_and_where_the_prior_finds_the_first(family):
    """`task.lookalikes`: the house's decoys (one per num_decoys), each a wrong focus, the first in the room
    a prior points to (not the start room whenever there are two rooms for them)."""
    for decoys in (0, 1, 2):
        env = make_env("minisci", num_rooms=5, num_decoys=decoys, num_distractors=1)
        for variation in catalogue().split(family, "test")[:5]:
            env.reset(task=family, variation=variation)
            world, task = env._world, env._task
            assert len(task.lookalikes) == decoys and set(task.lookalikes) <= set(world.things)
            assert not any(task.accepts_focus(world, name) for name in task.lookalikes)
            if family == "find-living-thing" and decoys:
                assert world.room_of(task.lookalikes[0]) == task.obvious_room


# ----- catalogue and determinism ---------------------------------------------------------------
def test_splits_are_disjoint_and_cover_the_variations():
    cat = catalogue()
    assert set(cat.variations) == set(FAMILIES) and cat.ood_tasks == list(OOD_FAMILIES) == ["change-state"]
    assert "change-state" not in cat.tasks() and "change-state" in cat.tasks(include_ood=True)
    for family in FAMILIES:
        train, dev, test = (set(cat.split(family, s)) for s in ("train", "dev", "test"))
        assert not (train & dev or train & test or dev & test)
        assert train | dev | test == set(range(NUM_VARIATIONS))
        assert (len(train), len(dev), len(test)) == (150, 75, 75)
    assert cat.split("mix-paint", "test") != cat.split("power-component", "test")


def fingerprint() -> dict:
    """Everything a process could disagree on: the splits, and observations and state keys along
    the gold path of a few instances per family."""
    env = make_env("minisci")
    out = {"catalogue": catalogue().variations, "episodes": {}}
    for family in FAMILIES:
        for variation in catalogue().split(family, "test")[:3]:
            obs, _ = env.reset(task=family, variation=variation)
            trace = [obs, env.state_key()]
            for action in env.gold_actions():
                trace += [env.step(action).obs, env.state_key()]
            out["episodes"][f"{family}/{variation}"] = trace
    return out


def test_splits_and_worlds_are_identical_in_another_process():
    code = "import json; from tests.unit.test_minisci import fingerprint; print(json.dumps(fingerprint()))"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different str-hash salt than this process
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        check=True,
        timeout=60,
    )
    assert json.loads(done.stdout) == json.loads(json.dumps(fingerprint()))


def test_reset_without_variation_draws_train_variations_from_the_seed():
    def draws(seed):
        env = make_env("minisci", seed=seed)
        return [env.reset(task="mix-paint")[1]["variation"] for _ in range(8)]

    assert draws(3) == draws(3) != draws(4)
    assert set(draws(3)) <= set(catalogue().split("mix-paint", "train"))
    env = make_env("minisci")
    assert env.reset(task="change-state", variation=9) == env.reset(task="change-state", variation=9)
    assert env.reset()[1]["task"] == "change-state"  # the task defaults to the previous one


def test_gold_actions_function_matches_env_and_difficulty_changes_the_house():
    env = make_env("minisci", **HARD)
    env.reset(task="measure-temperature", variation=7)
    assert env.gold_actions() == gold_actions("measure-temperature", 7, **HARD)
    assert gold_actions("measure-temperature", 7) != gold_actions("measure-temperature", 7, **HARD)


# ----- state key -------------------------------------------------------------------------------
def test_state_key_tracks_room_inventory_and_task_state():
    a, b = make_env("minisci"), make_env("minisci")
    a.reset(task="find-living-thing", variation=5)
    b.reset(task="find-living-thing", variation=5)
    start = a.state_key()
    assert start == b.state_key() and len(start) == 24
    a.step("look around")
    assert a.state_key() == start  # looking changes nothing that matters
    room = a._world.exits[a._world.location][0]
    back = a._world.location
    a.step(f"go to {room}")
    moved = a.state_key()
    assert moved != start
    b.step(f"go to {room}")
    assert b.state_key() == moved
    a.step(f"go to {back}")
    assert a.state_key() == start
    carry = next(x for x in a.valid_actions() if x.startswith("pick up "))
    a.step(carry)
    assert a.state_key() != start
    b.reset(task="find-living-thing", variation=6)
    assert b.state_key() != start


# ----- actions ---------------------------------------------------------------------------------
def test_invalid_action_leaves_state_unchanged_when_correction_is_off():
    env = make_env("minisci", action_correction=False)
    obs, _ = env.reset(task="power-component", variation=2)
    key = env.state_key()
    for text in ("go hallway", "pick up unicorn", "focus on the moon", "dance"):
        result = env.step(text)
        assert (
            result.info["invalid_action"] and not result.info["corrected"] and result.info["action"] is None
        )
        assert result.obs == "No known action matches that input." and result.reward == 0 and not result.done
        assert env.state_key() == key and env.step("look around").obs == obs
    assert result.info["steps"] == 7


def test_correction_picks_the_closest_valid_action():
    env = make_env("minisci")
    env.reset(task="find-living-thing", variation=5)
    room = env._world.exits[env._world.location][0]
    result = env.step(f"Action: Go {room}!!")
    assert result.info["parsed_action"] == f"go {room}!!"
    assert result.info["corrected"] and result.info["action"] == f"go to {room}"
    assert env._world.location == room
    result = env.step("xyzzy")
    assert result.info["invalid_action"] and not result.info["corrected"]


@pytest.mark.parametrize("correction", [True, False])
def test_no_model_output_crashes_a_step(correction):
    env = make_env("minisci", action_correction=correction, max_steps=100)
    env.reset(task="mix-paint", variation=1)
    junk = [
        "",
        " ",
        "\x00",
        "\x00" * 50,
        "a" * 10_000,
        "go to " + "x" * 10_000,
        "<|im_start|>assistant\n",
        "<|im_end|>",
        "\x1b[31mopen\x07",
        "put in",
        "put  in on",
        "connect to to to",
        "use on",
        "focus on",
        "focus on ",
        "open door to",
        "go to inventory",
        "pick up inventory",
        "mix",
        "\ud800",
        "🙂 look around",
        "LOOK AROUND",
        None,
        12345,
        "\n\n\nwait\n",
    ]
    for text in junk:
        result = env.step(text)
        assert isinstance(result.obs, str) and INFO_KEYS <= set(result.info)
        assert 0 <= result.info["score"] <= 100
    env.reset(task="mix-paint", variation=1)  # a bare "focus on" may be corrected into a (wrong) focus
    assert env.step("LOOK AROUND").info["action"] == "look around"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_listed_valid_action_is_accepted(family):
    env = make_env("minisci", action_correction=False, closed_doors=True, hide_prob=0.5)
    rng = random.Random(1)
    env.reset(task=family, variation=11)
    for action in env.gold_actions()[:-1] + ["wait"]:
        for candidate in env.valid_actions():
            assert candidate == " ".join(candidate.split()) == candidate.lower()
            trial = copy.deepcopy(env)
            assert not trial.step(candidate).info["invalid_action"], candidate
        env.step(action)
        env.step(rng.choice([a for a in env.valid_actions() if not a.startswith("focus on ")]))


def test_every_environment_defaults_to_the_configs_reward_scale():
    """`make_env` callers get the reward a run gets: score points (env.reward_scale's default)."""
    import inspect

    from empo2.config import EnvConfig
    from empo2.envs.minisci.env import MiniSciEnv
    from empo2.envs.scienceworld import ScienceWorldTextEnv
    from empo2.envs.textworld import TextWorldEnv

    for cls in (MiniSciEnv, ScienceWorldTextEnv, TextWorldEnv):
        assert inspect.signature(cls).parameters["reward_scale"].default == EnvConfig.reward_scale, cls.__name__
    env = make_env("minisci")
    assert sum(r.reward for r in run_gold(env, "change-state", 4)) == pytest.approx(100.0)


def test_reward_is_the_scaled_score_change_and_episodes_truncate():
    for scale in (0.01, 1.0):
        env = make_env("minisci", reward_scale=scale)
        total = sum(r.reward for r in run_gold(env, "change-state", 4))
        assert total == pytest.approx(100 * scale)
    env = make_env("minisci", max_steps=3)
    env.reset(task="mix-paint", variation=0)
    results = [env.step("wait") for _ in range(3)]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["truncated"] and not results[-1].info["won"]
    after = env.step("look around")
    assert after.done and after.reward == 0.0


def test_bad_configuration_raises():
    with pytest.raises(ValueError):
        make_env("minisci", num_rooms=20)
    with pytest.raises(ValueError):
        make_env("minisci", hide_prob=2.0)
    env = make_env("minisci")
    with pytest.raises(ValueError):
        env.reset(task="find-unicorn")
    with pytest.raises(ValueError):
        env.reset(task="mix-paint", variation=NUM_VARIATIONS)


# ----- physics ---------------------------------------------------------------------------------
def _bench() -> World:
    world = World()
    world.add_room("workshop")
    world.location = "workshop"
    for thing in (
        Thing("battery", portable=True, role="battery"),
        Thing("bulb", role="load"),
        Thing("wire", portable=True, role="wire"),
    ):
        world.add(thing, "workshop")
    return world


def test_circuit_needs_a_closed_loop_without_a_short():
    world = _bench()
    world.connect("battery anode", "bulb terminal 1")
    assert not world.powered("bulb")
    world.connect("bulb terminal 2", "wire terminal 1")
    world.connect("wire terminal 2", "battery cathode")
    assert world.powered("bulb")
    world.connect("battery anode", "battery cathode")  # a short bypasses the bulb
    assert not world.powered("bulb")
    world.disconnect("battery")
    world.connect("battery cathode", "bulb terminal 1")  # polarity does not matter for a bulb
    world.connect("battery anode", "wire terminal 2")
    assert world.powered("bulb")
    world.move("battery", INVENTORY)  # carrying a part away pulls its wires
    assert not world.powered("bulb") and "battery anode" not in world.links


def test_heat_and_cold_change_phase_only_while_the_appliance_works():
    env = make_env("minisci")
    env.reset(task="change-state", variation=4)
    water = env._world.things[env._task.substance]
    before = water.temp
    for _ in range(3):
        env.step("wait")
    assert water.temp == before  # nothing heats or cools outside a working appliance


def test_wrong_paints_mix_to_brown():
    world = World()
    world.add_room("art studio")
    world.location = "art studio"
    world.add(Thing("bowl", prep="in", role="mixer"), "art studio")
    for colour in ("red", "blue", "yellow"):
        world.add(Thing(f"{colour} paint", portable=True, colour=colour), "bowl")
    assert world.mix("bowl") == "brown paint" and world.things["bowl"].contents == ["brown paint"]
    assert world.mix("bowl") is None


def test_catalogue_sample_can_be_limited_to_the_first_train_variations():
    from empo2.envs import get_catalogue

    cat = get_catalogue("minisci")
    drawn = cat.sample(200, "train", seed=3, variations=2)
    allowed = {(t, v) for t in cat.tasks() for v in cat.split(t, "train")[:2]}
    assert {(s.task, s.variation) for s in drawn} == allowed  # 200 draws cover all 8 instances, nothing else
    assert cat.sample(5, "train", seed=3, variations=2) == cat.sample(5, "train", seed=3, variations=2)


def test_catalogue_sample_draws_instances_without_replacement():
    from empo2.envs import get_catalogue

    cat = get_catalogue("minisci")
    pool = {(t, v) for t in cat.tasks() for v in cat.split(t, "train")[:2]}
    drawn = [(s.task, s.variation) for s in cat.sample(len(pool), "train", seed=1, variations=2)]
    assert sorted(drawn) == sorted(pool)  # no instance twice while others are left out
    more = [(s.task, s.variation) for s in cat.sample(len(pool) + 3, "train", seed=1, variations=2)]
    assert set(more[:len(pool)]) == pool and len(set(more[len(pool):])) == 3
