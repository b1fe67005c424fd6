"""The console of a run: the per-iteration line (1-based iteration, key numbers, elapsed and an ETA from the mean
pace) and the live bar's text (the phase with its own count); the run's time by phase (MLflow and the closing
report)."""

import time

import pytest

from empo2.lit.progress import (
    BAR_STATS,
    PHASES,
    Phase,
    PhaseTimes,
    bar_description,
    eta_line,
    iteration_stats,
    phase_table,
    stat_values,
)


def test_eta_extrapolates_the_mean_time_of_the_iterations_run_here():
    stats = {"rollout/score": 25.04, "rollout/success": 0.125, "memory/size": 40.0, "val/score_nomem": 12.5}
    # 3 iterations in 62 s, 20 of 24 left after iteration index 3: 62 / 3 * 20 = 413.3 s
    line = eta_line(3, 24, 3, 62.0, stats)
    assert line == "iteration 4/24  score 25.0  success 0.12  val 12.5  memory 40  elapsed 1:02  ETA 6:53"


def test_the_last_iteration_has_no_time_left_and_hours_show_as_such():
    assert eta_line(23, 24, 24, 4000.0, {}).endswith("elapsed 1:06:40  ETA 0:00")
    assert "with tips 30.0  tip-free 10.0" in eta_line(0, 2, 1, 1.0, {"rollout/score_mem": 30.0,
                                                                   "rollout/score_nomem": 10.0})


def test_a_phase_counts_in_its_own_unit_and_tells_its_listener():
    seen = []
    phase = Phase(listener=lambda p: seen.append(str(p)))
    assert str(phase) == ""  # before the first phase: nothing to show
    phase.set("rollouts", 15, 16, 2)
    phase.set("update", 0, 12, 2)
    phase.advance()
    phase.set("validation", 4, 8, 2)
    assert seen == ["rollouts 15/16 episodes", "update 0/12 steps", "update 1/12 steps", "validation 4/8 episodes"]
    assert (phase.name, phase.done, phase.total, phase.iteration) == ("validation", 4, 8, 2)


def test_the_bar_text_holds_the_phase_and_an_eta_that_counts_the_running_iteration():
    phase = Phase()
    phase.set("rollouts", 5, 16, 2)
    # 2 iterations finished in 60 s (70 s elapsed, 10 s into the third): 30 s each; 21 more after this one,
    # and 20 s of this one left: 650 s
    text = bar_description(24, phase, 2, 70.0, 10.0)
    assert text == "iteration 3/24  rollouts 5/16 episodes  elapsed 1:10  ETA 10:50"
    phase.set("update", 3, 12, 2)
    assert bar_description(24, phase, 2, 100.0, 40.0).endswith("update 3/12 steps  elapsed 1:40  ETA 10:30")
    phase.set("rollouts", 0, 16, 0)  # nothing finished yet: no pace to extrapolate
    assert bar_description(24, phase, 0, 5.0, 5.0) == "iteration 1/24  rollouts 0/16 episodes  elapsed 0:05  ETA -:--"
    phase.set("validation", 1, 8, -1)
    assert bar_description(24, phase, 0, 3.0, 3.0).startswith("before training  validation 1/8 episodes")


def test_iteration_stats_merge_one_iteration_and_the_bar_shows_score_success_and_memory():
    history = [{"iteration": -1, "val/score_nomem": 5.0},
               {"iteration": 0, "rollout/score": 10.0, "rollout/success": 0.25, "memory/size": 4.0},
               {"iteration": 0, "val/score_nomem": 12.5},
               {"iteration": 1, "rollout/score": 20.0, "rollout/success": 0.5, "memory/size": 8.0}]
    assert iteration_stats(history, 0) == {"iteration": 0, "rollout/score": 10.0, "rollout/success": 0.25,
                                           "memory/size": 4.0, "val/score_nomem": 12.5}
    assert iteration_stats(history)["rollout/score"] == 20.0  # the latest iteration by default
    assert iteration_stats([]) == {}
    assert stat_values(iteration_stats(history), BAR_STATS) == [("score", "20.0"), ("success", "0.50"), ("memory", "8")]


def test_the_iteration_line_keeps_its_width_whatever_times_an_iteration_logs():
    stats = {"rollout/score": 25.04, "memory/size": 40.0}
    timed = dict(stats, **{f"time/{key}_s": 1.0 for key, _ in PHASES})
    assert eta_line(3, 24, 3, 62.0, timed) == eta_line(3, 24, 3, 62.0, stats)


def test_phase_times_add_up_with_other_to_the_wall_and_the_table_shares_to_100_percent():
    times = PhaseTimes(start=time.perf_counter() - 10.0)  # a run that began 10 s ago
    assert times.add(generate=3.0, env=1.5) == {"time/generate_s": 3.0, "time/env_s": 1.5}
    times.add(generate=1.0)
    assert times.since("update", time.perf_counter() - 2.0)["time/update_s"] == pytest.approx(2.0, abs=0.1)
    report = times.report()
    assert report["phases_s"]["generate"] == 4.0 and report["phases_s"]["checkpoint"] == 0.0
    assert list(report["phases_s"]) == [key for key, _ in PHASES]
    assert report["wall_s"] == pytest.approx(10.0, abs=0.1)
    assert sum(report["phases_s"].values()) + report["other_s"] == pytest.approx(report["wall_s"])
    phases = dict(report["phases_s"], startup=50.0, update=2.5)  # 58 s in phases
    lines = phase_table({"wall_s": 200.0, "phases_s": phases, "other_s": 142.0})
    assert lines[0] == "where the time went (3:20 wall):"
    rows = {line[:22].strip(): line[22:].split() for line in lines[2:]}
    assert list(rows) == [label for _, label in PHASES] + ["other"]
    assert rows["start-up"] == ["0:50", "25.0%"] and rows["generation"] == ["0:04", "2.0%"]
    assert sum(float(share.rstrip("%")) for _, share in rows.values()) == pytest.approx(100.0, abs=0.1)
