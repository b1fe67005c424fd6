"""The phase the progress bar shows, as a real training run reports it: rollouts counted in finished episodes,
the update in optimiser steps, validation in episodes, each phase of each iteration run to its total."""

import itertools

import lightning as L

from empo2.config import load_config
from empo2.lit.callbacks import RolloutCallback
from empo2.rollout.build import validation_tasks
from empo2.train import train
from tests.integration.test_training import FAST


class PhaseLog(L.Callback):
    """Hears every phase change beside the progress bar."""

    def __init__(self):
        self.seen: list[tuple[int, str, int, int]] = []

    def setup(self, trainer, pl_module, stage):
        phase = next(c for c in trainer.callbacks if isinstance(c, RolloutCallback)).phase
        shown = phase.listener  # the bar's

        def record(p):
            self.seen.append((p.iteration, p.name, p.done, p.total))
            shown(p)

        phase.listener = record


def test_each_iteration_runs_its_rollouts_update_and_validation_phases_to_their_totals(tmp_path):
    cfg = load_config(FAST + ["trainer.val_before_train=true", "trainer.val_memory=true", f"run_root={tmp_path}",
                              "run_name=r"])
    log = PhaseLog()
    train(cfg, callbacks=[log])
    phases = [(it, name, list(steps)) for (it, name), steps in
              itertools.groupby(log.seen, key=lambda s: (s[0], s[1]))]
    assert [(it, name) for it, name, _ in phases] == [(-1, "validation"), (0, "rollouts"), (0, "update"),
                                                      (0, "validation"), (1, "rollouts"), (1, "update"),
                                                      (1, "validation")]
    episodes = {"rollouts": cfg.rollout.tasks_per_batch * cfg.rollout.group_size,
                "validation": 2 * len(validation_tasks(cfg))}  # memory off and on
    for it, name, steps in phases:
        dones = [done for _, _, done, _ in steps]
        assert dones[0] == 0 and dones == sorted(dones), (it, name, dones)  # counts up from zero
        assert {total for *_, total in steps} == {dones[-1]}, (it, name)  # to its total, which never moves
        if name == "update":
            assert dones == list(range(dones[-1] + 1)) and dones[-1] > 0  # one optimiser step at a time
        else:
            assert dones[-1] == episodes[name], (it, name)
