"""The per-iteration console line: 1-based iteration, key numbers, elapsed and an ETA from the mean pace."""

from empo2.lit.progress import eta_line


def test_eta_extrapolates_the_mean_time_of_the_iterations_run_here():
    stats = {"rollout/score": 25.04, "rollout/success": 0.125, "memory/size": 40.0, "val/score_nomem": 12.5}
    # 3 iterations in 62 s, 20 of 24 left after iteration index 3: 62 / 3 * 20 = 413.3 s
    line = eta_line(3, 24, 3, 62.0, stats)
    assert line == "iteration 4/24  score 25.0  success 0.12  val 12.5  memory 40  elapsed 1:02  ETA 6:53"


def test_the_last_iteration_has_no_time_left_and_hours_show_as_such():
    assert eta_line(23, 24, 24, 4000.0, {}).endswith("elapsed 1:06:40  ETA 0:00")
    assert "with tips 30.0  tip-free 10.0" in eta_line(0, 2, 1, 1.0, {"rollout/score_memory": 30.0,
                                                                   "rollout/score_tipfree": 10.0})
