"""The phase the progress bar shows, as a real training run reports it: rollouts counted in finished episodes,
the update in optimiser steps, validation in episodes, each phase of each iteration run to its total; and where the
run's time went, per iteration in MLflow and in total in the closing report."""

import itertools
import time

import lightning as L
import pytest
from mlflow.tracking import MlflowClient

from empo2.config import load_config
from empo2.lit.callbacks import RolloutCallback
from empo2.lit.progress import PHASES, phase_table
from empo2.rollout.build import validation_tasks
from empo2.workflows.train import train
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


EARLIER_S = 5.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two iterations of the tiny model, validated before training and after each iteration, tracked in MLflow;
    begun, as `empo2 train` begins its run before its imports and config, `EARLIER_S` before the call."""
    root = tmp_path_factory.mktemp("phases")
    cfg = load_config(FAST + ["trainer.val_before_train=true", "trainer.val_mem=true", "logger=mlflow",
                              f"run_root={root}", "run_name=r"])
    log = PhaseLog()
    return cfg, log, train(cfg, callbacks=[log], started=time.perf_counter() - EARLIER_S)


def test_each_iteration_runs_its_rollouts_update_and_validation_phases_to_their_totals(run):
    cfg, log, _ = run
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


def test_the_run_says_where_its_time_went_per_iteration_in_mlflow_and_in_total(run):
    cfg, _, summary = run
    phases = summary["phases"]
    totals = phases["phases_s"]
    assert list(totals) == [key for key, _ in PHASES] and all(s >= 0 for s in totals.values())
    # everything but the weight sync (the HF engine generates with the policy itself: nothing to load) took time
    assert all(totals[key] > 0 for key, _ in PHASES if key != "weight_sync"), totals
    assert phases["other_s"] >= 0  # the phases never overlap
    assert sum(totals.values()) + phases["other_s"] == pytest.approx(phases["wall_s"])
    assert phases["wall_s"] == pytest.approx(summary["metrics"]["time/total_s"], abs=1.0)
    assert totals["startup"] > EARLIER_S  # the caller's start counts: start-up and the wall include its seconds
    shares = [float(line.split()[-1].rstrip("%")) for line in phase_table(phases)[2:]]
    # each share is printed to 0.1%: their sum is 100% within half of that per row
    assert len(shares) == len(PHASES) + 1 and sum(shares) == pytest.approx(100.0, abs=0.05 * len(shares))
    assert 0.1 < phases["peak_rss_gib"] < 20

    client = MlflowClient(summary["mlflow_tracking_uri"])
    run_id = summary["mlflow_run_id"]
    iterations = list(range(cfg.trainer.iterations))
    steps = {"startup": [0], "validation": [-1, *iterations]}  # start-up once; validation before training too
    for key, _ in PHASES:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, f"time/{key}_s"))
        assert [step for step, _ in history] == steps.get(key, iterations), key
        assert all(v >= 0 for _, v in history), key
        if key != "weight_sync":  # the sync after the last iteration has no iteration left to be logged with
            assert sum(v for _, v in history) == pytest.approx(totals[key], rel=1e-6, abs=1e-6), key
