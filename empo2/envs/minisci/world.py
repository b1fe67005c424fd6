"""MiniSci's world state: rooms joined by doors, the things in them, the agent, and the small
amount of physics every task family shares (containers, electrical circuits, heat and cold, paint).

Everything here is plain Python data mutated in place; a `World` is rebuilt from its variation
seed at every reset, so nothing needs copying. Names are lowercase and unique across the world:
they are what the agent types.
"""

from __future__ import annotations

INVENTORY = "inventory"  # parent of everything the agent carries

HEAT_PER_TICK = 30  # degrees an activated stove adds to each thing on it per tick
COLD_PER_TICK = 15  # degrees a closed freezer removes from each thing in it per tick
MIN_TEMP, MAX_TEMP = -20, 250

SECONDARY_COLOURS = {
    frozenset(("blue", "yellow")): "green",
    frozenset(("red", "yellow")): "orange",
    frozenset(("red", "blue")): "purple",
}
# Words for a change of phase, keyed by (before, after).
_PHASE_VERBS = {
    ("solid", "liquid"): "melts",
    ("liquid", "gas"): "boils",
    ("solid", "gas"): "boils",
    ("liquid", "solid"): "freezes",
    ("gas", "liquid"): "condenses",
    ("gas", "solid"): "freezes",
}


class Thing:
    """One object. `role` marks what the shared physics does with it: "battery", "load" (a powered
    component), "wire", "thermometer" or "mixer"; `device` marks a stove ("heat") or a freezer
    ("cold"). Things with a `prep` ("in" or "on") hold other things in `contents`."""

    __slots__ = (
        "name",
        "parent",
        "contents",
        "prep",
        "portable",
        "closable",
        "is_open",
        "article",
        "device",
        "active",
        "role",
        "terminals",
        "temp",
        "melt",
        "boil",
        "colour",
    )

    def __init__(
        self,
        name: str,
        *,
        portable: bool = False,
        prep: str | None = None,
        closable: bool = False,
        is_open: bool = True,
        article: str | None = None,
        device: str | None = None,
        role: str | None = None,
        temp: float | None = None,
        melt: float | None = None,
        boil: float | None = None,
        colour: str | None = None,
    ) -> None:
        self.name = name
        self.parent = ""
        self.contents: list[str] | None = [] if prep else None
        self.prep = prep
        self.portable = portable
        self.closable = closable
        self.is_open = is_open
        self.article = article or ("an" if name[0] in "aeiou" else "a")
        self.device = device
        self.active = False
        self.role = role
        if role == "battery":
            self.terminals: tuple[str, ...] = (f"{name} anode", f"{name} cathode")
        elif role in ("load", "wire"):
            self.terminals = (f"{name} terminal 1", f"{name} terminal 2")
        else:
            self.terminals = ()
        self.temp = temp
        self.melt = melt
        self.boil = boil
        self.colour = colour

    def phase(self) -> str | None:
        if self.melt is None or self.temp is None:
            return None
        return phase_of(self.temp, self.melt, self.boil)


class World:
    """The whole mutable state of one episode."""

    def __init__(self) -> None:
        self.rooms: dict[str, list[str]] = {}  # room -> names of the things directly in it
        self.exits: dict[str, list[str]] = {}  # room -> neighbouring rooms, in a fixed order
        self.doors: dict[tuple[str, str], bool] = {}  # sorted room pair -> door open
        self.things: dict[str, Thing] = {}
        self.inventory: list[str] = []
        self.location = ""
        self.terminal_owner: dict[str, str] = {}
        self.links: dict[str, list[str]] = {}  # terminal -> terminals wired to it
        self.focused: list[str] = []
        self.measured: set[str] = set()
        self.failed = False  # set by a focus the task rejects
        self.devices: list[Thing] = []  # stoves and freezers, so a tick touches only them

    # ----- construction -------------------------------------------------------------------
    def add_room(self, room: str) -> None:
        self.rooms[room] = []
        self.exits[room] = []

    def join(self, a: str, b: str, is_open: bool) -> None:
        self.exits[a].append(b)
        self.exits[b].append(a)
        self.doors[door_key(a, b)] = is_open

    def add(self, thing: Thing, parent: str) -> Thing:
        if thing.name in self.things or thing.name in self.rooms:
            # Names are what the agent types, so each must pick out one thing.
            raise ValueError(f"duplicate name {thing.name!r}")
        self.things[thing.name] = thing
        if thing.device:
            self.devices.append(thing)
        for terminal in thing.terminals:
            self.terminal_owner[terminal] = thing.name
        thing.parent = parent
        self._holder(parent).append(thing.name)
        return thing

    # ----- where things are ---------------------------------------------------------------
    def _holder(self, parent: str) -> list[str]:
        if parent == INVENTORY:
            return self.inventory
        room = self.rooms.get(parent)
        return room if room is not None else self.things[parent].contents

    def room_of(self, name: str) -> str:
        """The room a thing is in, or INVENTORY when the agent carries it (directly or not)."""
        parent = self.things[name].parent
        while parent in self.things:
            parent = self.things[parent].parent
        return parent

    def _reachable(self, name: str, allow_inventory: bool) -> bool:
        parent = self.things[name].parent
        while parent in self.things:
            holder = self.things[parent]
            if holder.closable and not holder.is_open:
                return False
            parent = holder.parent
        return parent == self.location or (allow_inventory and parent == INVENTORY)

    def visible(self, name: str) -> bool:
        """In the current room or the inventory, and not shut inside a closed container."""
        return name in self.things and self._reachable(name, allow_inventory=True)

    def in_room(self, name: str) -> bool:
        """Visible and lying in the current room (not carried): what wiring needs."""
        return name in self.things and self._reachable(name, allow_inventory=False)

    def visible_things(self) -> list[str]:
        """Every visible thing, room first, then inventory, in a stable order."""
        found: list[str] = []
        stack = list(reversed(self.rooms[self.location])) + list(reversed(self.inventory))
        while stack:
            name = stack.pop()
            found.append(name)
            thing = self.things[name]
            if thing.contents and thing.is_open:
                stack.extend(reversed(thing.contents))
        return found

    def move(self, name: str, parent: str) -> None:
        """Move a thing; moving pulls out the wires of it and of everything inside it."""
        thing = self.things[name]
        self._holder(thing.parent).remove(name)
        thing.parent = parent
        self._holder(parent).append(name)
        stack = [name]
        while stack:
            moved = self.things[stack.pop()]
            self.disconnect(moved.name)
            stack.extend(moved.contents or ())

    def encloses(self, outer: str, inner: str) -> bool:
        """Whether `inner` is `outer` or lies somewhere inside it."""
        while inner in self.things:
            if inner == outer:
                return True
            inner = self.things[inner].parent
        return False

    def door_open(self, a: str, b: str) -> bool:
        return self.doors[door_key(a, b)]

    # ----- electricity --------------------------------------------------------------------
    def connect(self, a: str, b: str) -> None:
        self.links.setdefault(a, []).append(b)
        self.links.setdefault(b, []).append(a)

    def disconnect(self, name: str) -> bool:
        """Remove every wire on a thing's terminals; whether there was any."""
        had_any = False
        for terminal in self.things[name].terminals:
            for other in self.links.pop(terminal, ()):
                self.links[other].remove(terminal)
                if not self.links[other]:
                    del self.links[other]
                had_any = True
        return had_any

    def _conducted(self, start: str, skip: str) -> set[str]:
        """Terminals reachable from `start` through wires and through every wire or load except
        `skip` (a battery does not conduct from anode to cathode on its own)."""
        seen, stack = {start}, [start]
        while stack:
            terminal = stack.pop()
            nxt = list(self.links.get(terminal, ()))
            owner = self.things[self.terminal_owner[terminal]]
            if owner.name != skip and owner.role in ("wire", "load"):
                nxt.append(owner.terminals[1] if terminal == owner.terminals[0] else owner.terminals[0])
            for other in nxt:
                if other not in seen:
                    seen.add(other)
                    stack.append(other)
        return seen

    def powered(self, name: str) -> bool:
        """A load is powered when one terminal reaches a battery's anode and the other its cathode,
        without a short circuit that bypasses it."""
        first, second = self.things[name].terminals
        if first not in self.links or second not in self.links:
            return False
        for battery in self.things.values():
            if battery.role != "battery":
                continue
            anode, cathode = battery.terminals
            from_anode = self._conducted(anode, skip=name)
            if cathode in from_anode:
                continue
            if first in from_anode and second in self._conducted(cathode, skip=name):
                return True
            if second in from_anode and first in self._conducted(cathode, skip=name):
                return True
        return False

    def wired_to_battery(self, name: str) -> bool:
        """Whether a terminal of `name` is wired (directly or through other parts) to a battery."""
        first, second = self.things[name].terminals
        if first not in self.links and second not in self.links:
            return False
        for battery in self.things.values():
            if battery.role == "battery":
                for terminal in battery.terminals:
                    reached = self._conducted(terminal, skip=name)
                    if first in reached or second in reached:
                        return True
        return False

    # ----- heat, cold and paint -----------------------------------------------------------
    def tick(self) -> list[str]:
        """Advance time by one action: stoves heat and closed freezers cool what they hold."""
        messages = []
        for device in self.devices:
            if device.device == "heat":
                if not device.active:
                    continue
                delta = HEAT_PER_TICK
            elif device.is_open:
                continue
            else:
                delta = -COLD_PER_TICK
            for name in device.contents:
                thing = self.things[name]
                if thing.temp is None:
                    continue
                before = thing.phase()
                thing.temp = min(MAX_TEMP, max(MIN_TEMP, thing.temp + delta))
                after = thing.phase()
                if after != before:
                    messages.append(f"The {name} {_PHASE_VERBS[(before, after)]}.")
        return messages

    def mix(self, mixer: str) -> str | None:
        """Mix the paints in a container into one new paint; None when fewer than two are there.
        The three primaries can form each product at most once, so the new name is always free."""
        holder = self.things[mixer]
        paints = [n for n in holder.contents if self.things[n].colour]
        if len(paints) < 2:
            return None
        colours = frozenset(self.things[n].colour for n in paints)
        colour = SECONDARY_COLOURS.get(colours, "brown")
        for name in paints:
            holder.contents.remove(name)
            del self.things[name]
        self.add(Thing(f"{colour} paint", portable=True, article="some", colour=colour), mixer)
        return f"{colour} paint"

    # ----- text ---------------------------------------------------------------------------
    def describe(self, name: str) -> str:
        thing = self.things[name]
        notes = []
        if thing.closable:
            notes.append("that is open" if thing.is_open else "that is closed")
        if thing.device == "heat":
            notes.append("which is turned on" if thing.active else "which is turned off")
        if thing.role == "load":
            notes.append("which is on" if self.powered(name) else "which is off")
        phase = thing.phase()
        if phase:
            notes.append(f"in a {phase} state")
        if thing.contents is not None and thing.is_open:
            inner = ", ".join(self.describe(n) for n in thing.contents) or "nothing"
            notes.append(("containing " if thing.prep == "in" else "on which is ") + inner)
        label = f"{thing.article} {name}"
        return f"{label} ({'; '.join(notes)})" if notes else label

    def look_around(self) -> str:
        lines = [f"This room is called the {self.location}. In it, you see:", "\tthe agent"]
        lines += [f"\t{self.describe(n)}" for n in self.rooms[self.location]]
        lines.append("You also see:")
        for room in self.exits[self.location]:
            state = "open" if self.door_open(self.location, room) else "closed"
            lines.append(f"\tA door to the {room} (that is {state})")
        return "\n".join(lines)

    def describe_inventory(self) -> str:
        if not self.inventory:
            return "Your inventory is empty."
        return "In your inventory, you see:\n" + "\n".join(f"\t{self.describe(n)}" for n in self.inventory)


def phase_of(temp: float, melt: float, boil: float | None) -> str:
    if temp <= melt:
        return "solid"
    if boil is not None and temp >= boil:
        return "gas"
    return "liquid"


def door_key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)
