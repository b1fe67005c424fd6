"""Families about searching the house: find a living thing, and power a component (whose battery
is rarely where a prior puts it)."""

from __future__ import annotations

import random

from empo2.envs.minisci.layout import Difficulty, Planner, build_house, place_key, put_somewhere, rooms_except
from empo2.envs.minisci.task import Task, decoy_rooms, start_agent
from empo2.envs.minisci.world import INVENTORY, Thing, World

# ----- find a living thing -------------------------------------------------------------------
ANIMALS = (
    "frog",
    "turtle",
    "rabbit",
    "beaver",
    "chipmunk",
    "moth",
    "bee",
    "parrot",
    "butterfly",
    "snail",
    "lizard",
    "hamster",
    "toad",
    "spider",
)
PLANTS = ("fern", "cactus", "sunflower", "tomato plant", "bamboo shoot", "oak sapling", "orchid", "moss")
FAKE_ANIMALS = (
    "toy dog",
    "stuffed bear",
    "picture of a cat",
    "plastic frog",
    "rubber duck",
    "porcelain horse",
    "dinosaur fossil",
    "wooden owl",
)
FAKE_PLANTS = ("plastic plant", "silk flower", "painting of a tree", "paper rose", "dried leaf", "wooden log")
# category -> (what counts, the room a prior points to, what tempts a wrong focus)
FIND_CATEGORIES = {
    "animal": (ANIMALS, "outside", FAKE_ANIMALS + PLANTS),
    "plant": (PLANTS, "greenhouse", FAKE_PLANTS + ANIMALS),
    "living thing": (ANIMALS + PLANTS, "greenhouse", FAKE_ANIMALS + FAKE_PLANTS),
}
BOXES = ("red box", "blue box", "green box", "purple box")


class FindTask(Task):
    family = "find-living-thing"
    max_steps = 30

    @classmethod
    def build(cls, rng: random.Random, difficulty: Difficulty) -> tuple[World, FindTask]:
        category = rng.choice(sorted(FIND_CATEGORIES))
        targets, obvious, decoys = FIND_CATEGORIES[category]
        world = build_house(rng, difficulty, (obvious,))
        target_room = rng.choice(rooms_except(world, obvious))
        start = start_agent(world, rng, target_room)
        box, box_room = rng.choice(BOXES), rng.choice(list(world.rooms))
        world.add(Thing(box, prep="in"), box_room)
        target = rng.choice(targets)
        place_key(world, rng, difficulty, Thing(target, portable=True), target_room)
        lookalikes = rng.sample(decoys, difficulty.num_decoys)
        for name, room in zip(lookalikes, decoy_rooms(obvious, start, difficulty.num_decoys)):
            put_somewhere(world, rng, Thing(name, portable=True), room)
        article = "an" if category[0] in "aeiou" else "a"
        description = (
            f"Your task is to find {article} {category}. First, focus on the thing. "
            f"Then, move it to the {box} in the {box_room}."
        )
        task = cls(description, target, box, box_room, obvious)
        task.lookalikes = tuple(lookalikes)
        task.candidates = targets  # what the task's category admits: a target of this task in some house
        return world, task

    def __init__(self, description: str, target: str, box: str, box_room: str, obvious_room: str) -> None:
        super().__init__(description, (target, box), sought=(target,))
        self.target, self.box, self.box_room = target, box, box_room
        self.obvious_room = obvious_room  # where the look-alikes wait and the target never is

    @property
    def signature(self) -> str:
        return f"{self.box}, {self.box_room}"

    def accepts_focus(self, world: World, name: str) -> bool:
        return name == self.target

    def progress(self, world: World) -> tuple[int, bool]:
        if self.target not in world.focused:
            return (25 if world.visible(self.target) else 0), False
        if world.things[self.target].parent == self.box:
            return 100, True
        return (75 if world.room_of(self.target) == INVENTORY else 50), False

    def gold(self, world: World) -> list[str]:
        plan = Planner(world)
        plan.visit(self.target)
        plan.add(f"focus on {self.target}", f"pick up {self.target}")
        plan.go(self.box_room)
        plan.add(f"put {self.target} in {self.box}")
        return plan.actions


# ----- power a component ---------------------------------------------------------------------
COMPONENTS = (
    "red light bulb",
    "green light bulb",
    "blue light bulb",
    "yellow light bulb",
    "electric motor",
    "electric buzzer",
)
WIRES = ("black wire", "orange wire")
WORKSHOP = "workshop"
BATTERY = "battery"


class PowerTask(Task):
    family = "power-component"
    max_steps = 30

    @classmethod
    def build(cls, rng: random.Random, difficulty: Difficulty) -> tuple[World, PowerTask]:
        world = build_house(rng, difficulty, (WORKSHOP,))
        start_agent(world, rng)
        component, *decoys = rng.sample(COMPONENTS, 1 + difficulty.num_decoys)
        for name in [component, *decoys]:
            world.add(Thing(name, role="load"), WORKSHOP)
        for wire in WIRES:
            put_somewhere(world, rng, Thing(wire, portable=True, role="wire"), WORKSHOP)
        # The battery is where a prior puts it (the workshop) only one time in three.
        battery_room = WORKSHOP if rng.random() < 1 / 3 else rng.choice(rooms_except(world, WORKSHOP))
        place_key(world, rng, difficulty, Thing(BATTERY, portable=True, role="battery"), battery_room)
        description = (
            f"Your task is to turn on the {component}. First, focus on the {component}. "
            "Then, create an electrical circuit that powers it on."
        )
        task = cls(description, component)
        task.lookalikes = tuple(decoys)
        return world, task

    def __init__(self, description: str, component: str) -> None:
        super().__init__(description, (component, BATTERY, *WIRES), sought=(BATTERY,))
        self.component = component

    @property
    def signature(self) -> str:
        return self.component

    def accepts_focus(self, world: World, name: str) -> bool:
        return name == self.component

    def progress(self, world: World) -> tuple[int, bool]:
        if self.component not in world.focused:
            return 0, False
        if world.powered(self.component):
            return 100, True
        if world.wired_to_battery(self.component):
            return 75, False
        return (50 if world.room_of(BATTERY) == WORKSHOP else 25), False

    def gold(self, world: World) -> list[str]:
        plan = Planner(world)
        if world.room_of(BATTERY) == WORKSHOP:
            plan.visit(BATTERY)
        else:
            plan.fetch(BATTERY)
            plan.go(WORKSHOP)
            plan.add(f"put down {BATTERY}")
        plan.add(
            f"focus on {self.component}",
            f"connect {BATTERY} anode to {self.component} terminal 1",
            f"connect {self.component} terminal 2 to {BATTERY} cathode",
        )
        return plan.actions
