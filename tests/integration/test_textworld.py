"""TextWorld adapter on real generated games: walkthroughs win, the game cache is atomic and reused,
the step contract holds. Games are small levels, generated once into this module's cache folder."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from empo2.envs import get_catalogue, make_env
from empo2.envs import textworld_games as games
from empo2.envs.base import SPLITS
from empo2.envs.textworld import INVALID_OBS, clean_feedback

needs_textworld = pytest.mark.needs("textworld")


@pytest.fixture(scope="module", autouse=True)
def game_cache(tmp_path_factory):
    """One cache folder for the module, so each game is generated once however many tests play it;
    the module scope keeps other test modules on their own cache."""
    root = tmp_path_factory.mktemp("empo2-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EMPO2_CACHE", str(root))
        yield root


@pytest.fixture
def env():
    e = make_env("textworld", seed=0, reward_scale=0.01)  # rewards in [0, 1]: the sums below are fractions
    yield e
    e.close()


def _play(env, actions):
    results = [env.step(a) for a in actions]
    return results, sum(r.reward for r in results)


# ------------------------------------------------------------------------- catalogue (no games)
def test_catalogue_lists_tasks_without_generating_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path))
    cat = get_catalogue("textworld")
    assert not list(tmp_path.iterdir())
    assert set(cat.tasks(include_ood=True)) == set(games.TASKS)
    assert {t for t in games.TASKS if t.startswith("tw-simple/")} <= set(cat.ood_tasks)  # the unseen challenge
    assert {"tw-coin_collector/30", "tw-treasure_hunter/23", "tw-cooking/6"} <= set(cat.ood_tasks)
    assert not set(cat.tasks()) & set(cat.ood_tasks)
    for task in cat.tasks(include_ood=True):
        parts = [set(cat.split(task, s)) for s in SPLITS]
        assert [len(p) for p in parts] == [100, 50, 50]
        assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])
    assert get_catalogue("textworld").variations == cat.variations


@pytest.mark.parametrize("task, needle", [
    ("tw-coin_collector", "'<challenge>/<level>'"),
    ("tw-zork/3", "unknown TextWorld challenge 'tw-zork'"),
    ("tw-coin_collector/05", "without leading zeros"),
    ("tw-coin_collector/160", "level 160 of TextWorld task 'tw-coin_collector/160' is out of range"),
    ("tw-treasure_hunter/31", "tw-treasure_hunter levels: 1-30"),
    ("tw-cooking/7", "tw-cooking levels: 1-6"),
])
def test_bad_task_names_are_rejected_by_name(task, needle):
    with pytest.raises(ValueError) as err:
        games.check_task(task)
    assert needle in str(err.value)


def test_game_seeds_differ_across_levels_and_variations():
    seeds = {games.game_seed(t, v) for t in ("tw-coin_collector/5", "tw-coin_collector/105") for v in range(50)}
    assert len(seeds) == 100 and all(0 <= s < 2**31 for s in seeds)


def test_feedback_loses_prompt_status_bar_banner_and_objective():
    raw = ("\n\n  ________ \n |  $$  \\ \n\nFind the coin.\n\n-= Kitchen =-\nA kitchen.\n\n\n\n"
           "                   *** The End ***\n\nWould you like to RESTART, RESTORE a saved game, QUIT or UNDO the "
           "last command?\n>          -= Kitchen =-0/4")
    assert clean_feedback(raw, "Find the coin.") == "-= Kitchen =-\nA kitchen.\n\n*** The End ***"


def test_missing_extra_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "textworld", None)  # makes `import textworld` raise ImportError
    with pytest.raises(ImportError, match=r"pip install -e \.\[textworld\]"):
        make_env("textworld")


# ------------------------------------------------------------------------------ real games
WALKTHROUGH_GAMES = [
    ("tw-coin_collector/2", 0), ("tw-coin_collector/5", 1), ("tw-coin_collector/103", 2),
    ("tw-treasure_hunter/3", 0), ("tw-treasure_hunter/8", 1), ("tw-treasure_hunter/12", 2),
    ("tw-cooking/1", 0), ("tw-cooking/2", 1), ("tw-cooking/3", 2),
    ("tw-simple/1", 0), ("tw-simple/2", 1), ("tw-simple/3", 2),
]


def _assert_walkthrough_wins(env, task, variation):
    obs, info = env.reset(task=task, variation=variation)
    assert info["score"] == 0 and not info["won"] and info["steps"] == 0 and obs
    assert env.task_description and env.task_description not in obs
    assert "*** The End ***" not in obs and "\n>" not in obs
    gold = env.gold_actions()
    assert gold
    results, total = _play(env, gold)
    for action, res in zip(gold, results):
        assert res.info["action"] == action and not res.info["corrected"] and not res.info["invalid_action"]
        assert 0 <= res.info["score"] <= 100 and not res.info["lost"]
    assert [r.done for r in results] == [False] * (len(gold) - 1) + [True]
    last = results[-1]
    assert last.info["won"] and last.info["score"] == 100 and not last.info["truncated"]
    assert total == pytest.approx(1.0)  # reward_scale 0.01 times the 0-100 score


@needs_textworld
@pytest.mark.parametrize("task, variation", WALKTHROUGH_GAMES, ids=lambda x: str(x))
def test_walkthrough_from_the_game_file_wins(env, task, variation):
    _assert_walkthrough_wins(env, task, variation)


@needs_textworld
@pytest.mark.slow
@pytest.mark.parametrize("task", ["tw-coin_collector/30", "tw-coin_collector/210", "tw-treasure_hunter/20",
                                  "tw-treasure_hunter/23", "tw-cooking/5", "tw-cooking/6", "tw-simple/4"])
def test_walkthrough_wins_on_ood_levels(env, task):
    _assert_walkthrough_wins(env, task, get_catalogue("textworld").split(task, "test")[0])


@needs_textworld
def test_state_key_counts_rooms_and_inventory(env):
    env.reset(task="tw-coin_collector/5", variation=1)
    start = env.state_key()
    first_move = env.gold_actions()[0]
    back = {"north": "south", "south": "north", "east": "west", "west": "east"}[first_move.split()[1]]
    env.step("look")
    assert env.state_key() == start  # same room, same inventory
    env.step(first_move)
    assert env.state_key() != start
    env.step(f"go {back}")
    assert env.state_key() == start  # a revisited room counts as the same state
    other = make_env("textworld")
    try:
        other.reset(task="tw-coin_collector/5", variation=1)
        assert other.state_key() == start  # process- and instance-independent
        other.reset(task="tw-coin_collector/2", variation=0)
        assert other.state_key() != start
    finally:
        other.close()
    env.reset(task="tw-coin_collector/5", variation=1)
    keys = [env.state_key()] + [(env.step(a), env.state_key())[1] for a in env.gold_actions()]
    assert len(set(keys)) == len(keys)  # every move enters a new room; taking the coin changes the inventory


@needs_textworld
def test_invalid_and_corrected_actions(env):
    env.reset(task="tw-treasure_hunter/3", variation=0)
    valid = env.valid_actions()
    assert valid == sorted(valid) and all(a == a.lower() for a in valid) and "look" in valid
    gold = env.gold_actions()
    assert gold[0] in valid

    res = env.step(f"Action: {gold[0].upper()}.")
    assert res.info["action"] == gold[0] and not res.info["corrected"]

    key, valid = env.state_key(), env.valid_actions()
    res = env.step("xyzzy plugh")
    assert res.info["invalid_action"] and res.info["action"] is None and res.obs == INVALID_OBS
    assert res.reward == 0 and not res.done and res.info["steps"] == 2
    assert env.state_key() == key and env.valid_actions() == valid

    res = env.step("please examine everything")  # no admissible command is typed like that
    assert res.info["corrected"] and res.info["action"] in valid and res.info["action"].startswith("examine")

    strict = make_env("textworld", action_correction=False)
    try:
        strict.reset(task="tw-treasure_hunter/3", variation=0)
        res = strict.step("please examine everything")
        assert res.info["invalid_action"] and not res.info["corrected"] and res.info["action"] is None
    finally:
        strict.close()


@needs_textworld
def test_step_budget_truncates_and_ends_the_episode():
    env = make_env("textworld", max_steps=3, reward_scale=0.5)
    try:
        _, info = env.reset(task="tw-coin_collector/5", variation=1)
        assert info["max_steps"] == 3
        results, _ = _play(env, ["look", "inventory", "look"])
        assert [r.done for r in results] == [False, False, True]
        assert results[-1].info["truncated"] and not results[-1].info["won"]
        with pytest.raises(RuntimeError, match="episode is over"):
            env.step("look")
        _, info = env.reset(task="tw-coin_collector/5", variation=1)
        assert info["steps"] == 0
        results, _ = _play(env, ["look", "look"])
        assert not any(r.done for r in results) and results[-1].info["steps"] == 2
    finally:
        env.close()
    default = make_env("textworld")
    try:
        _, info = default.reset(task="tw-coin_collector/5", variation=1)
        assert info["max_steps"] == 50  # walkthrough of 5: the base budget
    finally:
        default.close()


@needs_textworld
def test_bad_constructor_and_reset_values():
    with pytest.raises(ValueError, match="max_steps"):
        make_env("textworld", max_steps=0)
    with pytest.raises(ValueError, match="generation_timeout_s"):
        make_env("textworld", generation_timeout_s=0)
    env = make_env("textworld")
    try:
        with pytest.raises(ValueError, match="reset\\(\\) needs a task"):
            env.reset()
        with pytest.raises(ValueError, match="variation must be a non-negative int"):
            env.reset(task="tw-coin_collector/2", variation=-1)
        with pytest.raises(RuntimeError, match="reset"):
            env.step("look")
    finally:
        env.close()


# ---------------------------------------------------------------------------------- the cache
@pytest.fixture
def generations(monkeypatch):
    """Counts child generator runs (the real ones still run)."""
    calls = []
    real = games._run_generator

    def counting(*args, **kwargs):
        calls.append(args[:3])
        return real(*args, **kwargs)

    monkeypatch.setattr(games, "_run_generator", counting)
    return calls


@needs_textworld
def test_concurrent_first_uses_generate_once_and_later_uses_read_the_cache(generations, game_cache):
    import textworld

    task, variation = "tw-treasure_hunter/5", 7
    paths, errors = [], []

    def use():
        try:
            paths.append(games.ensure_game(task, variation, timeout_s=120))
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=use) for _ in range(3)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first_s = time.monotonic() - t0
    assert not errors and len(paths) == 3 and len(set(paths)) == 1
    assert len(generations) == 1  # the other two waited on the lock, then found the game

    path = paths[0]
    folder = path.parent
    version, *key = folder.relative_to(game_cache / "textworld").parts
    assert version == f"{textworld.__version__}-r{games.GENERATOR_REVISION}"
    assert key == ["tw-treasure_hunter", "level-5", f"seed-{games.game_seed(task, variation)}"]
    meta = json.loads((folder / games.META_FILE).read_text())
    assert (meta["challenge"], meta["level"], meta["requested_seed"]) == ("tw-treasure_hunter", 5,
                                                                         games.game_seed(task, variation))
    mtime = path.stat().st_mtime_ns
    env = make_env("textworld")
    try:
        t0 = time.monotonic()
        env.reset(task=task, variation=variation)
        reset_s = time.monotonic() - t0
        assert env.gold_actions() == meta["walkthrough"]
    finally:
        env.close()
    # read, not made again: no generator call and the same file; and, measured on the same machine, a reset off the
    # cache is quicker than the first use that generated the game (a ratio, not a clock limit)
    assert len(generations) == 1 and path.stat().st_mtime_ns == mtime
    assert reset_s < first_s, (reset_s, first_s)
    assert not list(folder.parent.glob(".*tmp-*"))


def _child_pids(pid):
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while listing
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


@needs_textworld
def test_half_written_game_is_never_used(generations):
    task, variation = "tw-coin_collector/3", 11
    target = games.game_dir(task, variation)
    # A process killed while its generator is writing the game files.
    code = f"from empo2.envs.textworld_games import ensure_game; ensure_game({task!r}, {variation}, 120)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            any(tmp.iterdir()) for tmp in target.parent.glob(f".{target.name}.tmp-*")):
        time.sleep(0.02)
    generator = _child_pids(proc.pid)
    proc.kill()
    proc.wait()
    for pid in generator:  # the generator runs in its own process group, with the compilers it started
        os.killpg(pid, signal.SIGKILL)
    leftovers = list(target.parent.glob(f".{target.name}.tmp-*"))
    assert leftovers and not games.is_complete(target)
    # And a game folder without its completion marker (a copy cut short).
    target.mkdir()
    (target / "game.z8").write_bytes(b"\0" * 1000)
    (target / "game.json").write_text("{")

    env = make_env("textworld", reward_scale=0.01)  # as the fixture's: the walkthrough's rewards sum to 1
    try:
        _assert_walkthrough_wins(env, task, variation)
    finally:
        env.close()
    assert len(generations) == 1 and games.is_complete(target)
    assert not any(p.exists() for p in leftovers)


@needs_textworld
def test_generation_timeout_leaves_nothing_behind():
    task, variation = "tw-treasure_hunter/10", 13
    target = games.game_dir(task, variation)
    env = make_env("textworld", generation_timeout_s=0.2)  # far shorter than starting the generator
    try:
        with pytest.raises(games.GenerationTimeout, match="generation_timeout_s=0.2") as err:
            env.reset(task=task, variation=variation)
    finally:
        env.close()
    assert f"{task} variation {variation}" in str(err.value)
    assert not target.exists() and not list(target.parent.glob(".*tmp-*"))


@needs_textworld
def test_generator_failure_is_reported_with_its_output(tmp_path):
    with pytest.raises(games.GenerationError, match="failed \\(exit status 1\\)") as err:
        games._run_generator("tw-not-a-challenge", 1, 5, tmp_path, time.monotonic() + 60, "a test game", 60)
    assert "KeyError: 'tw-not-a-challenge'" in str(err.value)
