"""Houses for MiniSci: which rooms exist, how doors join them, the furniture and clutter in each,
where a task's key objects are put, and a planner that writes the shortest action path to them.

A house is a hallway hub with rooms off it, some of them reachable only through another room (as
the outside is through the kitchen in ScienceWorld). Every room has at least one closable
container, so any key object can be hidden.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from empo2.envs.minisci.world import Thing, World, door_key

HUB = "hallway"
# Furniture per room: (name, "in" | "on" | None, closable, device).
FURNITURE: dict[str, tuple[tuple[str, str | None, bool, str | None], ...]] = {
    "hallway": (("coat closet", "in", True, None), ("bench", "on", False, None)),
    "kitchen": (
        ("counter", "on", False, None),
        ("cupboard", "in", True, None),
        ("fridge", "in", True, None),
        ("freezer", "in", True, "cold"),
        ("stove", "on", False, "heat"),
    ),
    "bathroom": (
        ("bathtub", "in", False, None),
        ("medicine cabinet", "in", True, None),
        ("toilet", None, False, None),
    ),
    "workshop": (("workbench", "on", False, None), ("tool cabinet", "in", True, None)),
    "art studio": (
        ("art table", "on", False, None),
        ("supply cupboard", "in", True, None),
        ("easel", None, False, None),
    ),
    "greenhouse": (("planting bench", "on", False, None), ("seed cabinet", "in", True, None)),
    "living room": (
        ("couch", "on", False, None),
        ("coffee table", "on", False, None),
        ("sideboard", "in", True, None),
    ),
    "bedroom": (("bed", "on", False, None), ("closet", "in", True, None), ("nightstand", "on", False, None)),
    "outside": (
        ("picnic table", "on", False, None),
        ("shed", "in", True, None),
        ("fire pit", "in", False, None),
    ),
}
ROOMS = tuple(r for r in FURNITURE if r != HUB)
CLUTTER = (
    "book",
    "pencil",
    "glass jar",
    "paper clip",
    "spoon",
    "towel",
    "bar of soap",
    "candle",
    "clock",
    "shoe",
    "umbrella",
    "key",
    "notebook",
    "hammer",
    "screwdriver",
    "tape measure",
    "paintbrush",
    "pillow",
    "blanket",
    "lamp",
    "picture frame",
    "flashlight",
    "marble",
    "stapler",
    "sponge",
    "teapot",
    "vase",
    "ball of yarn",
    "pair of scissors",
    "ruler",
    "eraser",
    "magnifying glass",
    "toothbrush",
    "comb",
    "sock",
    "mug",
    "fork",
    "plate",
    "rope",
    "bucket",
    "glove",
    "hat",
)
SIDE_ROOM_PROB = 0.3  # chance a room hangs off another room instead of the hallway


@dataclass(frozen=True)
class Difficulty:
    """The knobs that make a MiniSci house harder to search; a variation is generated anew for each
    setting, so the same variation id under two settings is two different houses."""

    num_rooms: int = 6  # rooms in the house, hallway included (4 to 9)
    num_distractors: int = 2  # clutter objects per room (0 to 4)
    num_decoys: int = 2  # look-alikes of the task's target that a wrong focus picks (0 to 4)
    closed_doors: bool = False  # doors start closed and must be opened (ScienceWorld without "easy")
    hide_prob: float = 0.0  # chance each key object starts inside a closed container

    def __post_init__(self) -> None:
        if not 4 <= self.num_rooms <= len(FURNITURE):
            raise ValueError(f"num_rooms must be in [4, {len(FURNITURE)}], got {self.num_rooms}")
        if not 0 <= self.num_distractors <= 4:
            raise ValueError(f"num_distractors must be in [0, 4], got {self.num_distractors}")
        if not 0 <= self.num_decoys <= 4:
            raise ValueError(f"num_decoys must be in [0, 4], got {self.num_decoys}")
        if not 0.0 <= self.hide_prob <= 1.0:
            raise ValueError(f"hide_prob must be in [0, 1], got {self.hide_prob}")


def build_house(rng: random.Random, difficulty: Difficulty, required: tuple[str, ...]) -> World:
    """Rooms (`required` ones always present), doors, furniture and clutter; no agent position yet."""
    others = [r for r in ROOMS if r not in required]
    rng.shuffle(others)
    rooms = list(required) + others[: difficulty.num_rooms - 1 - len(required)]
    rng.shuffle(rooms)
    world = World()
    world.add_room(HUB)
    off_hub: list[str] = []
    for room in rooms:
        world.add_room(room)
        if off_hub and rng.random() < SIDE_ROOM_PROB:
            world.join(rng.choice(off_hub), room, not difficulty.closed_doors)
        else:
            world.join(HUB, room, not difficulty.closed_doors)
            off_hub.append(room)
    clutter = list(CLUTTER)
    rng.shuffle(clutter)
    for room in world.rooms:
        for name, prep, closable, device in FURNITURE[room]:
            world.add(Thing(name, prep=prep, closable=closable, is_open=not closable, device=device), room)
        for _ in range(difficulty.num_distractors):
            put_somewhere(world, rng, Thing(clutter.pop(), portable=True), room)
    return world


def put_somewhere(world: World, rng: random.Random, thing: Thing, room: str, hide: bool = False) -> None:
    """On the floor or a surface of `room`, or (`hide`) inside one of its closed containers."""
    furniture = [world.things[n] for n in world.rooms[room] if world.things[n].device is None]
    if hide:
        spots = [t.name for t in furniture if t.closable]
    else:
        spots = [room] + [t.name for t in furniture if t.prep == "on"]
    world.add(thing, rng.choice(spots))


def place_key(world: World, rng: random.Random, difficulty: Difficulty, thing: Thing, room: str) -> None:
    """Place a key object, hidden with probability `hide_prob` (the draw is made either way so the
    rest of the house does not change with `hide_prob`)."""
    put_somewhere(world, rng, thing, room, hide=rng.random() < difficulty.hide_prob)


def rooms_except(world: World, *excluded: str) -> list[str]:
    return [r for r in world.rooms if r != HUB and r not in excluded]


class Planner:
    """Writes a shortest action path on the initial world, remembering which doors and containers
    it has opened on the way."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.at = world.location
        self.actions: list[str] = []
        self._opened: set[str] = set()
        self._opened_doors: set[tuple[str, str]] = set()

    def add(self, *actions: str) -> None:
        self.actions.extend(actions)

    def go(self, room: str) -> None:
        for nxt in self._path(self.at, room):
            key = door_key(self.at, nxt)
            if not self.world.doors[key] and key not in self._opened_doors:
                self._opened_doors.add(key)
                self.add(f"open door to {nxt}")
            self.add(f"go to {nxt}")
            self.at = nxt

    def reveal(self, name: str) -> None:
        """Open the closed containers around `name`, outermost first (the agent is in its room)."""
        closed = []
        parent = self.world.things[name].parent
        while parent in self.world.things:
            holder = self.world.things[parent]
            if holder.closable and not holder.is_open and parent not in self._opened:
                closed.append(parent)
            parent = holder.parent
        for container in reversed(closed):
            self._opened.add(container)
            self.add(f"open {container}")

    def distance(self, room: str) -> int:
        """Moves from where the plan stands to `room`."""
        return len(self._path(self.at, room))

    def visit(self, name: str) -> None:
        """Go to the room of `name` and make it visible."""
        self.go(self.world.room_of(name))
        self.reveal(name)

    def fetch(self, name: str) -> None:
        self.visit(name)
        self.add(f"pick up {name}")

    def _path(self, start: str, goal: str) -> list[str]:
        previous: dict[str, str] = {start: start}
        queue = deque([start])
        while queue:
            room = queue.popleft()
            if room == goal:
                break
            for nxt in self.world.exits[room]:
                if nxt not in previous:
                    previous[nxt] = room
                    queue.append(nxt)
        path = []
        while goal != start:
            path.append(goal)
            goal = previous[goal]
        return path[::-1]
