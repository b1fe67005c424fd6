"""The fixed validation set a run plays and the line that announces it: the task types the run names for
validation, else those it trains on, else its environment's default (ScienceWorld: a short spread across the step
budgets; MiniSci and TextWorld: every in-distribution task, as before)."""

from empo2.config import load_config
from empo2.envs import TaskSpec, get_catalogue
from empo2.envs.scienceworld_tasks import DEFAULT_OOD_TASKS, TASK_BUDGETS
from empo2.rollout.build import validation_task_types, validation_tasks
from empo2.workflows.train import start_lines, validation_line

SPREAD = ["lifespan-longest-lived", "find-non-living-thing", "find-living-thing"]


def test_validation_plays_the_named_types_else_the_trained_ones_else_the_environments_default():
    sw = ["env=scienceworld"]
    assert validation_task_types(load_config(sw)) == SPREAD
    assert validation_task_types(load_config(sw + ["env.tasks=[boil,melt]"])) == ["boil", "melt"]
    assert validation_task_types(load_config(sw + ["env.tasks=[boil]", "env.val_tasks=[freeze]"])) == ["freeze"]
    # the paper preset validates on every in-distribution type, as the paper does
    assert load_config(["experiment=empo2_paper"]).env.val_default_tasks == []
    minisci = load_config([])
    assert validation_task_types(minisci) == get_catalogue("minisci").tasks()  # MiniSci's set is unchanged
    assert validation_task_types(load_config(["env.tasks=[mix-paint]"])) == ["mix-paint"]


def test_scienceworlds_default_spread_is_short_in_distribution_and_sized_by_the_variations():
    budgets = [TASK_BUDGETS[t] for t in SPREAD]
    assert budgets == sorted(budgets) and max(budgets) <= 20 and len(set(budgets)) == len(budgets)
    assert not set(SPREAD) & set(DEFAULT_OOD_TASKS)
    cfg = load_config(["env=scienceworld", "env.val_variations=1", "env.val_repeats=2"])
    tasks = validation_tasks(cfg)
    assert [t.task for t in tasks] == [t for t in SPREAD for _ in range(2)]  # 3 types x 1 variation x 2 repeats


def test_the_start_header_names_the_validation_set_with_its_step_budgets(tmp_path):
    cfg = load_config(["env=scienceworld", "env.val_variations=2", "trainer.val_every=5"])
    tasks = [TaskSpec(t, v) for t in SPREAD for v in (0, 1)]
    line = validation_line(cfg, tasks, TASK_BUDGETS.get)
    assert line == ("  validation: 6 episodes of test variations, every 5 iterations and after the last; step budgets "
                    "lifespan-longest-lived 10, find-non-living-thing 15, find-living-thing 20")
    assert start_lines(cfg, tmp_path, None, line)[2] == line
    fixed = load_config(["env=scienceworld", "env.max_steps=7"])  # one budget for every task
    assert validation_line(fixed, tasks[:1], TASK_BUDGETS.get).endswith("step budgets lifespan-longest-lived 7")
    many = [TaskSpec(f"t{i}", 0) for i in range(10)]  # no budget table: the names, the first 8 of them
    line = validation_line(load_config(["env=textworld", "env.max_steps=null"]), many)
    assert line.endswith("task types t0, t1, t2, t3, t4, t5, t6, t7 and 2 more")
