"""MiniSci's action grammar: carrying out one (already parsed, lowercase) action on a `World`, and
listing the valid actions of a state.

An action is *accepted* when it matches a template and names things the agent can see; it may
still fail in the world ("The fridge is closed."), as in ScienceWorld. Unmatched text returns None,
which the environment reports as an invalid action with the state unchanged. `valid_actions` lists
the useful accepted actions of a state (every listed action is accepted; some accepted ones, such as
opening what is already open or the reversed order of a `connect`, are not listed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from empo2.envs.minisci.world import INVENTORY, World, door_key

AMBIENT_TEMP = 20  # what a thermometer reads on a thing that has no temperature of its own


class TaskView(Protocol):
    """What the grammar needs from a task: its text (the `task` action) and its focus rule."""

    description: str

    def accepts_focus(self, world: World, name: str) -> bool: ...


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def _go(world: World, room: str) -> str | None:
    if room not in world.exits[world.location]:
        return None
    if not world.door_open(world.location, room):
        return f"The door to the {room} is closed."
    world.location = room
    return f"You move to the {room}.\n{world.look_around()}"


def _set_open(world: World, name: str, want_open: bool) -> str | None:
    verb = "open" if want_open else "closed"
    if name.startswith("door to "):
        room = name[8:]
        if room not in world.exits[world.location]:
            return None
        key = door_key(world.location, room)
        if world.doors[key] == want_open:
            return f"The door to the {room} is already {verb}."
        world.doors[key] = want_open
        return f"The door to the {room} is now {verb}."
    if not world.visible(name):
        return None
    thing = world.things[name]
    if not thing.closable:
        return f"The {name} cannot be {verb}."
    if thing.is_open == want_open:
        return f"The {name} is already {verb}."
    thing.is_open = want_open
    if want_open and thing.contents:
        return f"The {name} is now open. {_sentence(world.describe(name))}"
    return f"The {name} is now {verb}."


def _open(world: World, name: str) -> str | None:
    return _set_open(world, name, True)


def _close(world: World, name: str) -> str | None:
    return _set_open(world, name, False)


def _pick_up(world: World, name: str) -> str | None:
    if not world.visible(name):
        return None
    thing = world.things[name]
    if thing.parent == INVENTORY:
        return f"The {name} is already in your inventory."
    if not thing.portable:
        return f"The {name} is fixed in place."
    world.move(name, INVENTORY)
    return f"You move the {name} to the inventory."


def _put_down(world: World, name: str) -> str | None:
    if not world.visible(name):
        return None
    if world.things[name].parent != INVENTORY:
        return f"You are not holding the {name}."
    world.move(name, world.location)
    return f"You put down the {name}."


def _put(world: World, arg: str) -> str | None:
    for sep in (" in ", " on "):
        item, _, holder = arg.partition(sep)
        if holder and world.visible(item) and world.visible(holder):
            break
    else:
        return None
    target = world.things[holder]
    if world.room_of(item) != INVENTORY:
        return f"You need to pick up the {item} first."
    if target.contents is None:
        return f"You cannot put things {sep.strip()} the {holder}."
    if not target.is_open:
        return f"The {holder} is closed."
    if world.encloses(item, holder):
        return f"You cannot put the {item} inside itself."
    world.move(item, holder)
    return f"You move the {item} to the {holder}."


def _powered_loads(world: World) -> set[str]:
    return {n for n, t in world.things.items() if t.role == "load" and world.powered(n)}


def _connect(world: World, arg: str) -> str | None:
    parts = arg.split(" to ")
    if len(parts) != 2:
        return None
    first, second = parts
    owners = [world.terminal_owner.get(first), world.terminal_owner.get(second)]
    if None in owners or not all(world.visible(o) for o in owners):
        return None
    for owner in owners:
        if not world.in_room(owner):
            return f"You need to put down the {owner} before wiring it."
    if owners[0] == owners[1]:
        return f"You cannot connect the {owners[0]} to itself."
    if second in world.links.get(first, ()):
        return f"The {first} is already connected to the {second}."
    before = _powered_loads(world)
    world.connect(first, second)
    text = f"The {first} is now connected to the {second}."
    for load in sorted(_powered_loads(world) - before):
        text += f" The {load} turns on."
    return text


def _disconnect(world: World, name: str) -> str | None:
    if not world.visible(name):
        return None
    if world.disconnect(name):
        return f"The {name} is now disconnected."
    return f"Nothing is connected to the {name}."


def _use(world: World, arg: str) -> str | None:
    tool, _, target = arg.partition(" on ")
    if not (target and world.visible(tool) and world.visible(target)):
        return None
    if world.things[tool].role != "thermometer":
        return f"Using the {tool} on the {target} does nothing."
    if world.room_of(tool) != INVENTORY:
        return f"You need to pick up the {tool} first."
    temp = world.things[target].temp
    world.measured.add(target)
    reading = AMBIENT_TEMP if temp is None else round(temp)
    return f"The {tool} measures a temperature of {reading} degrees celsius."


def _set_active(world: World, name: str, want_active: bool) -> str | None:
    if not world.visible(name):
        return None
    thing = world.things[name]
    verb = "activated" if want_active else "deactivated"
    if thing.device != "heat":
        return f"The {name} cannot be {verb}."
    if thing.active == want_active:
        return f"The {name} is already {verb}."
    thing.active = want_active
    return f"The {name} is now {verb}."


def _activate(world: World, name: str) -> str | None:
    return _set_active(world, name, True)


def _deactivate(world: World, name: str) -> str | None:
    return _set_active(world, name, False)


def _mix(world: World, name: str) -> str | None:
    if not world.visible(name):
        return None
    if world.things[name].role != "mixer":
        return f"You cannot mix the {name}."
    product = world.mix(name)
    if product is None:
        return f"There is not enough paint in the {name} to mix."
    return f"The paints in the {name} mix into {product}."


def _look_at(world: World, name: str) -> str | None:
    if not world.visible(name):
        return None
    return _sentence(world.describe(name))


_EXACT: dict[str, Callable[[World], str]] = {
    "look around": World.look_around,
    "look": World.look_around,
    "inventory": World.describe_inventory,
    "wait": lambda world: "You wait.",
    "wait1": lambda world: "You wait.",
}
# Longer prefixes first: "put down " must win over "put ".
_PREFIXED: tuple[tuple[str, Callable[[World, str], str | None]], ...] = (
    ("go to ", _go),
    ("pick up ", _pick_up),
    ("look at ", _look_at),
    ("examine ", _look_at),
    ("put down ", _put_down),
    ("put ", _put),
    ("open ", _open),
    ("close ", _close),
    ("connect ", _connect),
    ("disconnect ", _disconnect),
    ("use ", _use),
    ("activate ", _activate),
    ("deactivate ", _deactivate),
    ("mix ", _mix),
)


def _focus(world: World, name: str, task: TaskView) -> str | None:
    if not world.visible(name):
        return None
    if name in world.focused:
        return f"You are already focused on the {name}."
    if task.accepts_focus(world, name):
        world.focused.append(name)
        return f"You focus on the {name}."
    world.failed = True
    return f"You focus on the {name}. That is not what the task asked for (task failed)."


def execute(world: World, action: str, task: TaskView) -> str | None:
    """Carry out `action`; the observation, or None when the action is not accepted."""
    handler = _EXACT.get(action)
    if handler is not None:
        return handler(world)
    if action.startswith("focus on "):
        return _focus(world, action[9:], task)
    if action == "task":
        return task.description
    for prefix, prefixed in _PREFIXED:
        if action.startswith(prefix):
            return prefixed(world, action[len(prefix) :])
    return None


def valid_actions(world: World) -> list[str]:
    """The useful accepted actions of the current state, in a stable order."""
    here = world.location
    actions = ["look around", "inventory", "wait", "task"]
    for room in world.exits[here]:
        actions.append(f"go to {room}")
        actions.append(f"{'close' if world.door_open(here, room) else 'open'} door to {room}")
    seen = world.visible_things()
    holders = [n for n in seen if world.things[n].contents is not None and world.things[n].is_open]
    terminals = []
    for name in seen:
        thing = world.things[name]
        actions.append(f"focus on {name}")
        actions.append(f"look at {name}")
        carried = world.room_of(name) == INVENTORY
        if thing.portable and thing.parent != INVENTORY:
            actions.append(f"pick up {name}")
        if thing.parent == INVENTORY:
            actions.append(f"put down {name}")
        if carried:
            for holder in holders:
                if not world.encloses(name, holder):
                    actions.append(f"put {name} {world.things[holder].prep} {holder}")
        if thing.closable:
            actions.append(f"{'close' if thing.is_open else 'open'} {name}")
        if thing.device == "heat":
            actions.append(f"{'deactivate' if thing.active else 'activate'} {name}")
        if thing.role == "mixer":
            actions.append(f"mix {name}")
        if thing.role == "thermometer" and carried:
            actions.extend(f"use {name} on {other}" for other in seen if other != name)
        if thing.terminals and not carried:
            if any(t in world.links for t in thing.terminals):
                actions.append(f"disconnect {name}")
            terminals.extend(thing.terminals)
    for i, first in enumerate(terminals):
        owner = world.terminal_owner[first]
        for second in terminals[i + 1 :]:
            if world.terminal_owner[second] != owner and second not in world.links.get(first, ()):
                actions.append(f"connect {first} to {second}")
    return actions
