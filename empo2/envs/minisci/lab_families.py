"""Families about substances: measure a temperature, mix paints, and change a state of matter
(the last is held out as the out-of-distribution family)."""

from __future__ import annotations

import random

from empo2.envs.minisci.layout import Difficulty, Planner, build_house, place_key, put_somewhere, rooms_except
from empo2.envs.minisci.task import Task, decoy_rooms, start_agent
from empo2.envs.minisci.world import COLD_PER_TICK, HEAT_PER_TICK, SECONDARY_COLOURS, Thing, World, phase_of

# ----- measure a temperature -----------------------------------------------------------------
THERMOMETER = "thermometer"
ANSWER_BOXES = ("orange box", "yellow box")


class MeasureTask(Task):
    family = "measure-temperature"
    max_steps = 40

    @classmethod
    def build(cls, rng: random.Random, difficulty: Difficulty) -> tuple[World, MeasureTask]:
        world = build_house(rng, difficulty, ())
        room = rng.choice(rooms_except(world))
        start_agent(world, rng)
        letters = rng.sample("abcdefgh", 1 + difficulty.num_decoys)
        temp = rng.randint(-10, 95)
        threshold = rng.choice([t for t in range(10, 90, 5) if abs(t - temp) >= 5])
        substance = f"unknown substance {letters[0]}"
        world.add(Thing(substance, temp=temp), room)
        for letter in letters[1:]:
            put_somewhere(world, rng, Thing(f"unknown substance {letter}", temp=rng.randint(-10, 95)), room)
        above, below = rng.sample(ANSWER_BOXES, 2)
        for box in ANSWER_BOXES:
            world.add(Thing(box, prep="in"), room)
        place_key(
            world,
            rng,
            difficulty,
            Thing(THERMOMETER, portable=True, role="thermometer"),
            rng.choice(rooms_except(world, room)),
        )
        description = (
            f"Your task is to measure the temperature of {substance}, which is located around the {room}. "
            f"First, focus on the thermometer. Next, focus on the {substance}. If the {substance} "
            f"temperature is above {threshold} degrees celsius, focus on the {above}. If the {substance} "
            f"temperature is below {threshold} degrees celsius, focus on the {below}. "
            f"The boxes are located around the {room}."
        )
        task = cls(description, substance, room, above if temp > threshold else below)
        task.lookalikes = tuple(f"unknown substance {letter}" for letter in letters[1:])
        return world, task

    def __init__(self, description: str, substance: str, room: str, answer: str) -> None:
        super().__init__(description, (THERMOMETER, substance), sought=(THERMOMETER,))
        self.substance, self.room, self.answer = substance, room, answer

    @property
    def signature(self) -> str:
        return f"{self.substance}, {self.room}"

    def accepts_focus(self, world: World, name: str) -> bool:
        """Focus order: thermometer, substance, then the answer box, which counts only once the
        substance was measured (an unmeasured answer is a guess)."""
        expected = (THERMOMETER, self.substance, self.answer)
        step = len(world.focused)
        if step >= len(expected) or name != expected[step]:
            return False
        return step < 2 or self.substance in world.measured

    def progress(self, world: World) -> tuple[int, bool]:
        focused = len(world.focused)
        if focused == 3:
            return 100, True
        if focused == 2 and self.substance in world.measured:
            return 70, False
        return (0, 20, 40)[focused], False

    def gold(self, world: World) -> list[str]:
        plan = Planner(world)
        plan.fetch(THERMOMETER)
        plan.add(f"focus on {THERMOMETER}")
        plan.go(self.room)
        plan.add(
            f"focus on {self.substance}", f"use {THERMOMETER} on {self.substance}", f"focus on {self.answer}"
        )
        return plan.actions


# ----- mix paints ----------------------------------------------------------------------------
ART_STUDIO = "art studio"
PRIMARIES = ("red", "blue", "yellow")
BOWL = "bowl"
LOOKALIKES = ("crayon", "ribbon", "marker", "balloon", "feather")


class MixTask(Task):
    family = "mix-paint"
    max_steps = 40

    @classmethod
    def build(cls, rng: random.Random, difficulty: Difficulty) -> tuple[World, MixTask]:
        world = build_house(rng, difficulty, (ART_STUDIO,))
        start = start_agent(world, rng)
        needed, colour = rng.choice(sorted(SECONDARY_COLOURS.items(), key=lambda kv: kv[1]))
        rooms = rooms_except(world)
        for primary in PRIMARIES:
            room = ART_STUDIO if rng.random() < 0.4 else rng.choice(rooms)
            place_key(
                world,
                rng,
                difficulty,
                Thing(f"{primary} paint", portable=True, article="some", colour=primary),
                room,
            )
        place_key(
            world, rng, difficulty, Thing(BOWL, portable=True, prep="in", role="mixer"), rng.choice(rooms)
        )
        lookalikes = [f"{colour} {kind}" for kind in rng.sample(LOOKALIKES, difficulty.num_decoys)]
        for name, room in zip(lookalikes, decoy_rooms(ART_STUDIO, start, difficulty.num_decoys)):
            put_somewhere(world, rng, Thing(name, portable=True), room)
        product = f"{colour} paint"
        description = (
            f"Your task is to use chemistry to create {product}. When you are done, focus on the {product}."
        )
        task = cls(description, tuple(f"{p} paint" for p in PRIMARIES if p in needed), product)
        task.lookalikes = tuple(lookalikes)
        return world, task

    def __init__(self, description: str, paints: tuple[str, ...], product: str) -> None:
        super().__init__(description, (*paints, BOWL, product), sought=(*paints, BOWL))
        self.paints, self.product = paints, product

    @property
    def signature(self) -> str:
        return self.product

    def accepts_focus(self, world: World, name: str) -> bool:
        return name == self.product

    def progress(self, world: World) -> tuple[int, bool]:
        if self.product in world.focused:
            return 100, True
        if self.product in world.things:
            return 75, False
        return 25 * sum(world.things[p].parent == BOWL for p in self.paints if p in world.things), False

    def gold(self, world: World) -> list[str]:
        plan = Planner(world)
        remaining = list(self.paints)
        while remaining:
            nearest = min(remaining, key=lambda paint: plan.distance(world.room_of(paint)))
            plan.fetch(nearest)
            remaining.remove(nearest)
        plan.visit(BOWL)
        plan.add(*(f"put {paint} in {BOWL}" for paint in self.paints))
        plan.add(f"mix {BOWL}", f"focus on {self.product}")
        return plan.actions


# ----- change the state of matter (held out as the out-of-distribution family) ---------------
KITCHEN = "kitchen"
# name -> (melting point, boiling point or None); all start at room temperature, 20 degrees.
SUBSTANCES = {
    "chocolate": (30, None),
    "butter": (35, None),
    "wax": (60, None),
    "water": (0, 100),
    "milk": (0, 100),
    "orange juice": (-2, 100),
    "apple juice": (-2, 100),
}
GOALS = {
    "melt": ("chocolate", "butter", "wax"),
    "boil": ("water", "milk"),
    "freeze": ("water", "orange juice", "apple juice"),
}
GOAL_PHASE = {"melt": "liquid", "boil": "gas", "freeze": "solid"}
ROOM_TEMP = 20


class ChangeStateTask(Task):
    family = "change-state"
    max_steps = 40

    @classmethod
    def build(cls, rng: random.Random, difficulty: Difficulty) -> tuple[World, ChangeStateTask]:
        world = build_house(rng, difficulty, (KITCHEN,))
        goal = rng.choice(sorted(GOALS))
        substance = rng.choice(GOALS[goal])
        room = rng.choice(rooms_except(world, KITCHEN))
        start = start_agent(world, rng, room)
        melt, boil = SUBSTANCES[substance]
        place_key(
            world,
            rng,
            difficulty,
            Thing(substance, portable=True, article="some", temp=ROOM_TEMP, melt=melt, boil=boil),
            room,
        )
        others = [s for s in sorted(SUBSTANCES) if s != substance]
        lookalikes = rng.sample(others, difficulty.num_decoys)
        for name, where in zip(lookalikes, decoy_rooms(KITCHEN, start, difficulty.num_decoys)):
            put_somewhere(
                world,
                rng,
                Thing(
                    name,
                    portable=True,
                    article="some",
                    temp=ROOM_TEMP,
                    melt=SUBSTANCES[name][0],
                    boil=SUBSTANCES[name][1],
                ),
                where,
            )
        description = (
            f"Your task is to {goal} {substance}. First, focus on the substance. Then, take actions "
            "that will cause it to change its state of matter."
        )
        task = cls(description, substance, goal)
        task.lookalikes = tuple(lookalikes)
        return world, task

    def __init__(self, description: str, substance: str, goal: str) -> None:
        self.appliance = "freezer" if goal == "freeze" else "stove"
        super().__init__(description, (substance, self.appliance), sought=(substance,))
        self.substance, self.goal = substance, goal

    @property
    def signature(self) -> str:
        return f"{self.goal} {self.substance}"

    def accepts_focus(self, world: World, name: str) -> bool:
        return name == self.substance

    def progress(self, world: World) -> tuple[int, bool]:
        if self.substance not in world.focused:
            return 0, False
        thing = world.things[self.substance]
        if thing.phase() == GOAL_PHASE[self.goal]:
            return 100, True
        if thing.parent != self.appliance:
            return 25, False
        appliance = world.things[self.appliance]
        working = appliance.active if appliance.device == "heat" else not appliance.is_open
        return (75 if working else 50), False

    def gold(self, world: World) -> list[str]:
        plan = Planner(world)
        plan.visit(self.substance)
        plan.add(f"focus on {self.substance}", f"pick up {self.substance}")
        plan.go(KITCHEN)
        if self.goal == "freeze":
            plan.add("open freezer", f"put {self.substance} in freezer", "close freezer")
            delta = -COLD_PER_TICK
        else:
            plan.add(f"put {self.substance} on stove", "activate stove")
            delta = HEAT_PER_TICK
        # The action that starts the appliance is itself one tick; wait out the rest.
        melt, boil = SUBSTANCES[self.substance]
        temp, ticks = ROOM_TEMP + delta, 1
        while phase_of(temp, melt, boil) != GOAL_PHASE[self.goal]:
            temp, ticks = temp + delta, ticks + 1
        plan.add(*["wait"] * (ticks - 1))
        return plan.actions
