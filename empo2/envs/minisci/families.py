"""MiniSci's task families. Each builds a house for one variation, says what a focus may pick,
scores partial progress and writes a gold action path.

Every family sets the same trap: the first tempting thing to `focus on` (a toy animal in the
garden, a second light bulb next to the asked one, an unknown substance with the wrong letter, a
crayon of the asked colour, a drink of the wrong kind) is wrong, and a wrong focus ends the
episode at score 0, while the thing the task needs lies in a room the agent has to search.
"""

from empo2.envs.minisci.lab_families import ChangeStateTask, MeasureTask, MixTask
from empo2.envs.minisci.search_families import FindTask, PowerTask
from empo2.envs.minisci.task import Task

FAMILIES: dict[str, type[Task]] = {
    cls.family: cls for cls in (FindTask, PowerTask, MeasureTask, MixTask, ChangeStateTask)
}
OOD_FAMILIES = (ChangeStateTask.family,)
