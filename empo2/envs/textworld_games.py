"""TextWorld's task catalogue, and the generated games behind it (made on first use, then cached).

Tasks are named `<challenge>/<level>`, e.g. `tw-coin_collector/5` or `tw-treasure_hunter/12`; a
variation is a game seed index. The game of (task, variation) is generated with the same calls as
`tw-make <challenge> --level <level> --seed <seed>` (`textworld.challenges.CHALLENGES[...]`, then
`textworld.generator.compile_game`), with the seed derived from (task, variation) by `stable_hash`, so
every process and machine gets the same game. Deviations from plain `tw-make`:

- coin collector and treasure hunter are generated with `grammar.only_last_action`: their default
  objective spells out every move of the route ("go south, then east, ..."), which turns an
  exploration benchmark into instruction following; with it, the objective names only the goal
  ("recover the coin from the floor of the bedroom");
- treasure hunter cannot place a quest on some maps (`QuestGenerationError`); the next seeds are
  tried, in order, so a variation always maps to the same game;
- the game's walkthrough is replayed once after compiling, kept without the commands that are not
  admissible when they come up, and must win (`admissible_walkthrough`).

`tw-cooking` and `tw-simple` take no level in `tw-make`; `COOKING_LEVELS` and `SIMPLE_LEVELS` (this
project's tables) give them one. Any valid level can be played; `catalogue()` lists a curated set.

Cache. A game lives in `$EMPO2_CACHE/textworld/<textworld version>-r<GENERATOR_REVISION>/<challenge>/
level-<L>/seed-<S>/`: `game.z8`, `game.json`, and `meta.json` (seeds, generation time, walkthrough),
written last. It is generated in a child process (killed at the deadline: some treasure-hunter levels
take minutes) into a temporary folder beside it, which is renamed into place only when complete; a
folder without `meta.json` is never used. A lock file per game makes concurrent processes wait for
one generator instead of repeating its work.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from empo2.envs.base import Catalogue, hash_splits, stable_hash
from empo2.utils import cache_root, fsync_path

CHALLENGES = ("tw-coin_collector", "tw-treasure_hunter", "tw-cooking", "tw-simple")

# Levels of the two challenges without one: a skill ladder in the spirit of the First TextWorld
# Problems games (recipe size, rooms to search, containers to open, cooking, cutting, a limited
# inventory). Keys are `tw-make tw-cooking` / `tw-make tw-simple` arguments.
COOKING_LEVELS: dict[int, dict] = {
    1: {"recipe": 1, "take": 1, "go": 1},
    2: {"recipe": 1, "take": 1, "go": 1, "cut": True},
    3: {"recipe": 1, "take": 1, "go": 1, "cut": True, "cook": True},
    4: {"recipe": 2, "take": 2, "go": 6, "open": True, "cut": True, "cook": True},
    5: {"recipe": 3, "take": 3, "go": 9, "open": True, "cut": True, "cook": True},
    6: {"recipe": 3, "take": 3, "go": 12, "open": True, "cut": True, "cook": True, "drop": True},
}
SIMPLE_LEVELS: dict[int, dict] = {
    1: {"rewards": "dense", "goal": "detailed"},
    2: {"rewards": "balanced", "goal": "detailed"},
    3: {"rewards": "sparse", "goal": "detailed"},
    4: {"rewards": "sparse", "goal": "brief"},
}

# The catalogue: (in-distribution levels, out-of-distribution levels) per challenge. Coin collector:
# 1-100 is a chain of `level` rooms, 101-150 adds a dead-end room beside each, 201-233 two. Treasure
# hunter: 1-10 five open rooms, 11-20 ten rooms with doors and containers, 21-30 twenty rooms with
# locked ones (levels above 25 are slow to generate, docs/performance.md, so the catalogue stops at 23).
# OOD = higher levels of a trained challenge, and the whole of tw-simple (a challenge never trained).
CATALOGUE_LEVELS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "tw-coin_collector": ((1, 2, 3, 5, 8, 10, 15, 101, 102, 103, 105, 110), (20, 30, 115, 120, 205, 210)),
    "tw-treasure_hunter": ((1, 3, 5, 8, 10, 11, 13, 15), (18, 20, 21, 23)),
    "tw-cooking": ((1, 2, 3, 4), (5, 6)),
    "tw-simple": ((), (1, 2, 3, 4)),
}
TASKS: tuple[str, ...] = tuple(f"{c}/{lv}" for c, (ind, ood) in CATALOGUE_LEVELS.items() for lv in ind + ood)
DEFAULT_OOD_TASKS: tuple[str, ...] = tuple(f"{c}/{lv}" for c, (_, ood) in CATALOGUE_LEVELS.items() for lv in ood)

NUM_VARIATIONS = 200  # per catalogue task; any non-negative variation can still be played
SPLIT_SIZES = {"train": 100, "dev": 50, "test": 50}

# Bump when the level tables or the generation options change: cached games of an older revision
# are then left alone instead of being reused as if they were the new ones.
GENERATOR_REVISION = 1
GOAL_ONLY_OBJECTIVE = ("tw-coin_collector", "tw-treasure_hunter")
QUEST_ATTEMPTS = 20  # seeds tried when treasure hunter finds no quest on a map
GAME_FILE, META_FILE = "game.z8", "meta.json"


class GenerationError(RuntimeError):
    """A game could not be generated (the message carries the generator's last output lines)."""


class GenerationTimeout(GenerationError):
    """Generating a game (or waiting for another process generating it) ran past the deadline."""


# ------------------------------------------------------------------------------------------- tasks
def _coin_collector_rooms(level: int) -> int:
    return ((level - 1) // 100 + 1) * ((level - 1) % 100 + 1)


def check_task(task: str) -> tuple[str, int]:
    """(challenge, level) of a task name `<challenge>/<level>`; ValueError naming what is wrong."""
    if not isinstance(task, str) or task.count("/") != 1:
        raise ValueError(f"TextWorld task must be '<challenge>/<level>' (e.g. 'tw-coin_collector/5'), got "
                         f"{task!r}; catalogue tasks: {list(TASKS)}")
    challenge, level_text = task.split("/")
    if challenge not in CHALLENGES:
        raise ValueError(f"unknown TextWorld challenge {challenge!r} in task {task!r}; known: {list(CHALLENGES)}")
    # One spelling per level ("5", not "05" or "+5"): the name seeds the games.
    if not re.fullmatch(r"[1-9][0-9]*", level_text):
        raise ValueError(f"level of TextWorld task {task!r} must be a positive integer without leading zeros, "
                         f"got {level_text!r}")
    level = int(level_text)
    if challenge == "tw-coin_collector":
        # TextWorld 1.7 compiles to Z-machine only, which caps games at 100 rooms.
        ok, allowed = 1 <= level <= 300 and _coin_collector_rooms(level) <= 100, "1-100, 101-150 or 201-233"
    elif challenge == "tw-treasure_hunter":
        ok, allowed = 1 <= level <= 30, "1-30"
    else:
        table = COOKING_LEVELS if challenge == "tw-cooking" else SIMPLE_LEVELS
        ok, allowed = level in table, f"{min(table)}-{max(table)}"
    if not ok:
        raise ValueError(f"level {level} of TextWorld task {task!r} is out of range; {challenge} levels: {allowed}")
    return challenge, level


def challenge_settings(challenge: str, level: int) -> dict:
    """The `tw-make <challenge>` arguments of a level (the parsed-argument dict `make` expects)."""
    if challenge in ("tw-coin_collector", "tw-treasure_hunter"):
        return {"level": level}
    if challenge == "tw-cooking":
        flags = dict.fromkeys(("open", "cook", "cut", "drop"), False)
        # recipe_seed 0 and split None are tw-make's defaults: the seed alone picks the recipe, from
        # the whole food distribution.
        return {**flags, **COOKING_LEVELS[level], "recipe_seed": 0, "split": None}
    return {**SIMPLE_LEVELS[level], "test": False}


def catalogue(ood_tasks: tuple[str, ...] | list[str] = DEFAULT_OOD_TASKS) -> Catalogue:
    """Per catalogue task, disjoint train/dev/test variation lists (100/50/50) cut from variations
    0-199 ordered by a hash of (task, variation); `ood_tasks` are held out. Generates nothing."""
    for task in ood_tasks:
        if task not in TASKS:
            raise ValueError(f"OOD task {task!r} is not in the TextWorld catalogue: {list(TASKS)}")
    variations = {task: hash_splits("textworld-split", task, SPLIT_SIZES) for task in TASKS}
    return Catalogue(variations=variations, ood_tasks=list(ood_tasks))


def game_seed(task: str, variation: int) -> int:
    """The generation seed of a task instance (below 2**31, so `seed + attempt` stays a valid numpy seed)."""
    return int(stable_hash("textworld-seed", task, str(variation)), 16) % 2**31


# ------------------------------------------------------------------------------------------- cache
def games_root() -> Path:
    from importlib.metadata import version

    return cache_root() / "textworld" / f"{version('textworld')}-r{GENERATOR_REVISION}"


def game_dir(task: str, variation: int) -> Path:
    challenge, level = check_task(task)
    return games_root() / challenge / f"level-{level}" / f"seed-{game_seed(task, variation)}"


def is_complete(folder: Path) -> bool:
    """A game folder counts only with its completion marker (written after the game files)."""
    return all((folder / name).is_file() for name in (GAME_FILE, "game.json", META_FILE))


def ensure_game(task: str, variation: int, timeout_s: float) -> Path:
    """Path of the compiled game of (task, variation), generating it first when it is not cached.

    Raises GenerationTimeout when generation (including waiting for another process generating
    the same game) takes more than `timeout_s`, GenerationError when the generator fails.
    """
    challenge, level = check_task(task)
    target = game_dir(task, variation)
    if is_complete(target):
        return target / GAME_FILE
    deadline = time.monotonic() + timeout_s
    target.parent.mkdir(parents=True, exist_ok=True)
    what = f"TextWorld game {task} variation {variation} (seed {game_seed(task, variation)})"
    with _exclusive(target.parent / f"{target.name}.lock", deadline, what, timeout_s):
        if is_complete(target):  # another process generated it while this one waited
            return target / GAME_FILE
        # Holding the lock, any temporary or unmarked folder of this game is a killed generator's.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _run_generator(challenge, level, game_seed(task, variation), tmp, deadline, what, timeout_s)
            os.replace(tmp, target)
            fsync_path(target.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target / GAME_FILE


@contextlib.contextmanager
def _exclusive(lock_path: Path, deadline: float, what: str, timeout_s: float) -> Iterator[None]:
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise GenerationTimeout(f"waited more than generation_timeout_s={timeout_s:g} s for another "
                                            f"process generating {what}") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


def _run_generator(challenge: str, level: int, seed: int, out: Path, deadline: float, what: str,
                   timeout_s: float) -> None:
    """Runs `generate` in a child process: a timed-out generation is killed with everything it
    started (the Inform 7 compilers), and TextWorld's global random state stays out of this process."""
    env = dict(os.environ)
    package_parent = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-c", _CHILD, challenge, str(level), str(seed), str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise GenerationTimeout(f"generating {what} took more than generation_timeout_s={timeout_s:g} s; "
                                f"choose a lower level or raise generation_timeout_s") from None
    if proc.returncode != 0 or not is_complete(out):
        tail = "\n".join(output.decode("utf-8", "replace").strip().splitlines()[-15:])
        raise GenerationError(f"generating {what} failed (exit status {proc.returncode}):\n{tail}")


# `-c` rather than `-m`: running this module as __main__ would import it twice (the package imports it).
_CHILD = ("import sys; from pathlib import Path; from empo2.envs.textworld_games import generate; "
          "generate(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))")


# ------------------------------------------------------------------------------ generation (child)
def generate(challenge: str, level: int, seed: int, out: Path) -> None:
    """Generate and compile one game into the empty folder `out`; `meta.json` is written last."""
    import textworld
    import textworld.challenges
    from textworld.generator import QuestGenerationError, compile_game

    start = time.monotonic()
    make = textworld.challenges.CHALLENGES[challenge][1]
    for attempt in range(QUEST_ATTEMPTS):
        options = textworld.GameOptions()
        options.seeds = seed + attempt
        options.path = str(out / GAME_FILE)
        options.grammar.only_last_action = challenge in GOAL_ONLY_OBJECTIVE
        try:
            game = make(settings=challenge_settings(challenge, level), options=options)
            break
        except QuestGenerationError:
            continue
    else:
        raise QuestGenerationError(f"no quest on {QUEST_ATTEMPTS} maps (seeds {seed}-{seed + QUEST_ATTEMPTS - 1})")
    compile_game(game, options)
    walkthrough = admissible_walkthrough(out / GAME_FILE, game.metadata["walkthrough"])
    for name in os.listdir(out):
        fsync_path(out / name)
    meta = {"challenge": challenge, "level": level, "seed": seed + attempt, "requested_seed": seed,
            "textworld": textworld.__version__, "generation_s": round(time.monotonic() - start, 3),
            "walkthrough": walkthrough}
    marker = out / META_FILE
    marker.write_text(json.dumps(meta, indent=1))
    fsync_path(marker)


def admissible_walkthrough(game_file: Path, walkthrough: list[str]) -> list[str]:
    """The game's walkthrough without the commands that are not admissible when they come up, checked
    to win. Cooking walkthroughs repeat "open <door>" on every pass through an open door ("That's
    already open."): a no-op in the game, but the env would correct it to an admissible command
    ("close <door>"). Lower case, like the env's admissible commands."""
    import textworld

    env = textworld.start(str(game_file), textworld.EnvInfos(admissible_commands=True, won=True))
    try:
        state, kept = env.reset(), []
        for command in walkthrough:
            if command in state["admissible_commands"]:
                state, _, _ = env.step(command)
                kept.append(command.lower())
        if not state["won"]:
            raise RuntimeError(f"the walkthrough {walkthrough} does not win through admissible commands")
        return kept
    finally:
        env.close()

