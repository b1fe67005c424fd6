"""Presets, grid files and sweep files: composition, the settings each preset stands for, and the
one-line errors for bad input."""

import dataclasses
import math

import pytest

from empo2.config import ConfigError, load_config
from empo2.evaluate import parse_kv
from empo2.experiments import available_presets
from empo2.grid import parse_seeds, plan_grid
from empo2.sweep import load_sweep

PRESETS = ["empo2_paper", "empo2_official", "grpo", "no_offpolicy", "no_intrinsic", "memory_only"]


def _cfg(preset, *more):
    return load_config([f"experiment={preset}", *more])


def test_every_preset_exists_in_a_gpu_and_a_minisci_variant():
    names = set(available_presets())
    for p in PRESETS:
        assert {p, f"{p}_minisci"} <= names


@pytest.mark.parametrize("preset", PRESETS)
def test_minisci_variant_keeps_the_algorithm_and_runs_on_cpu(preset):
    gpu, cpu = _cfg(preset), _cfg(f"{preset}_minisci")
    assert dataclasses.asdict(gpu.algo) == dataclasses.asdict(cpu.algo)
    assert dataclasses.asdict(gpu.memory) == dataclasses.asdict(cpu.memory)
    assert (gpu.env.name, gpu.model.name, gpu.trainer.strategy) == ("scienceworld", "qwen2.5-7b-instruct", "fsdp")
    assert (cpu.env.name, cpu.model.name, cpu.trainer.accelerator) == ("minisci", "smollm2-135m-instruct", "cpu")
    assert cpu.experiment == f"{preset}_minisci"


def test_paper_and_official_presets_hold_their_sources_values():
    paper, official = _cfg("empo2_paper"), _cfg("empo2_official")
    a = paper.algo
    assert (a.p, a.q, a.mode_granularity, a.delta, a.mask_mode) == (0.25, 0.68, "episode", 0.01, "token")
    assert (a.beta_start, a.beta_end, a.beta_schedule) == (0.8, 0.2, "linear")
    assert (paper.trainer.lr, paper.rollout.group_size, paper.rollout.tasks_per_batch) == (1e-6, 8, 16)
    b = official.algo
    assert (b.p, b.q, b.mode_granularity, b.mask_mode, b.delta) == (0.25, 0.68, "batch", "sequence", 0.0)
    assert (b.beta_start, b.beta_end, b.beta_schedule) == (1.0, 1.0, "constant")
    assert official.memory.per_step_entries and official.rollout.tip_max_new_tokens == 512
    m, r = official.memory, official.rollout
    assert (m.step_entry_key, m.key_text, m.rank_by, r.tips_in_history, official.env.train_variations) == \
        ("final", "history", "score", True, 5)
    m, r = paper.memory, paper.rollout
    assert (m.per_step_entries, m.key_text, m.rank_by, r.tips_in_history) == (False, "state", "similarity", False)


def test_ablation_presets_change_only_their_knob():
    grpo, no_off, no_int, mem = (_cfg(p) for p in ("grpo", "no_offpolicy", "no_intrinsic", "memory_only"))
    assert (grpo.algo.p, grpo.algo.beta_start, grpo.algo.beta_end, grpo.memory.enabled) == (0.0, 0.0, 0.0, False)
    assert (no_off.algo.q, no_off.algo.p, no_off.algo.beta_start) == (0.0, 0.25, 0.8)
    assert (no_int.algo.beta_start, no_int.algo.beta_end, no_int.algo.q) == (0.0, 0.0, 0.68)
    assert (mem.algo.update_policy, mem.memory.enabled, mem.algo.p) == (False, True, 1.0)


def test_command_line_overrides_win_over_the_preset():
    cfg = _cfg("no_offpolicy_minisci", "algo.q=0.3", "model=tiny")
    assert (cfg.algo.q, cfg.model.name, cfg.experiment) == (0.3, "tiny", "no_offpolicy_minisci")


def test_a_preset_file_path_works(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: grpo_minisci\noverrides: [algo.p=0.1]\n")
    cfg = load_config([f"experiment={path}"])
    assert (cfg.algo.p, cfg.memory.enabled, cfg.experiment) == (0.1, False, str(path))


@pytest.mark.parametrize("text, needle", [
    ("overrides: [algo.p=0.1]\nextra: 1\n", "unknown key 'extra'"),
    ("base: cyc\n", "cycle"),
    ("overrides: [experiment=grpo]\n", "use `base:`"),
    ("overrides: 3\n", "overrides must be a list of strings"),
    ("overrides: [algo.p=7]\n", "algo.p=7.0 is out of range"),
])
def test_bad_preset_files_give_one_line(tmp_path, text, needle):
    path = tmp_path / "cyc.yaml"
    path.write_text(text.replace("base: cyc", f"base: {path}"))
    with pytest.raises(ConfigError) as e:
        load_config([f"experiment={path}"])
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("override, needle", [
    ("experiment=no_such_preset", "unknown preset (available: "),
    ("experiment=/nowhere/x.yaml", "no such preset file"),
    ("experiment=ablations", "is a grid"),
])
def test_bad_preset_references(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config([override])


def test_only_one_preset_per_run():
    with pytest.raises(ConfigError, match="experiment is given 2 times"):
        load_config(["experiment=grpo", "experiment=no_intrinsic"])


@pytest.mark.parametrize("text, needle", [
    ("presets: [grpo]\nflavour: 1\n", "unknown key 'flavour'"),
    ("presets: []\n", "presets is empty"),
    ("presets: [no_such]\n", "no_such seed 0: experiment=no_such: unknown preset"),
    ("presets: [grpo_minisci]\noverrides: [logger=none]\n", "tracked in MLflow"),
    ("presets: [grpo_minisci]\nseeds: 0\n", "seeds=0 is out of range"),
])
def test_bad_grid_files_name_the_file(tmp_path, text, needle):
    path = tmp_path / "g.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        plan_grid(path)
    assert str(path) in str(e.value) and needle in str(e.value)


def test_missing_grid_file():
    with pytest.raises(ConfigError, match="grid file nope.yaml: no such file"):
        plan_grid("nope.yaml")


def test_seed_lists():
    assert parse_seeds(3, "s") == [0, 1, 2]
    assert parse_seeds("2", "s") == [0, 1]
    assert parse_seeds("0,5,7", "s") == [0, 5, 7]
    with pytest.raises(ConfigError):
        parse_seeds("1,1", "s")


SWEEP_HEAD = "study: s\npreset: grpo_minisci\n"


@pytest.mark.parametrize("text, needle", [
    ("space:\n  algo.delta: {type: float, low: 0.0, high: 0.1, log: true}\n", "algo.delta: log=true needs low > 0"),
    ("space:\n  algo.nope: {type: float, low: 0.0, high: 0.1}\n", "space.algo.nope: algo.nope: unknown key"),
    ("space:\n  algo.p: {type: float, low: 0.1, high: 1.5}\n", "space.algo.p: algo.p=1.5 is out of range"),
    ("space:\n  algo.p: {type: uniform, low: 0.1, high: 0.5}\n", "space.algo.p: expected a list of choices"),
    ("space:\n  algo.p: {type: float, low: 0.5, high: 0.1}\n", "low=0.5 must be below high=0.1"),
    ("space:\n  algo.mask_mode: [token, word]\n", "algo.mask_mode='word' is not allowed"),
    ("space:\n  algo.p: {type: float, low: 0.1, high: 0.5, lo: 1}\n", "unknown key 'lo'"),
    ("space: {}\n", "space is empty"),
    ("direction: up\nspace:\n  algo.p: [0.1]\n", "direction='up' is not allowed"),
    ("pruner: {type: median, n_warmup: 3}\nspace:\n  algo.p: [0.1]\n", "pruner:"),
    ("enqueue: [{algo.q: 0.1}]\nspace:\n  algo.p: [0.1]\n", "enqueue: 'algo.q' is not a key of space"),
])
def test_bad_sweep_files_name_the_file_and_key(tmp_path, text, needle):
    path = tmp_path / "s.yaml"
    path.write_text(SWEEP_HEAD + text)
    with pytest.raises(ConfigError) as e:
        load_sweep(path)
    assert str(e.value).startswith(str(path)) and needle in str(e.value) and "\n" not in str(e.value)


def test_sweep_overrides_are_typed_for_hydra(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SWEEP_HEAD + "space:\n  algo.mode_granularity: [step, batch]\n"
                    "  trainer.ppo_epochs: {type: int, low: 1, high: 3}\n")
    spec = load_sweep(path)
    gran, epochs = spec.space
    assert gran.override("batch") == "algo.mode_granularity='batch'" and epochs.override(2) == "trainer.ppo_epochs=2"
    assert load_config(spec.base + [gran.override("batch"), epochs.override(2)]).trainer.ppo_epochs == 2


def test_eval_arguments_split_options_from_overrides():
    opts, overrides = parse_kv(["ckpt=a", "memory=on", "env.val_variations=2"], ("ckpt", "memory"))
    assert opts == {"ckpt": "a", "memory": "on"} and overrides == ["env.val_variations=2"]
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_kv(["ckpt"], ("ckpt",))


def test_group_curve_averages_runs_per_step_and_places_points_at_the_mean_x():
    from empo2.compare import group_curve

    a = ({0: 1.0, 1: 3.0}, {0: 10.0, 1: 22.0})
    b = ({0: 3.0, 1: 5.0, 2: 7.0}, {0: 12.0, 1: 20.0, 2: 30.0})
    x, mean, std = group_curve([a, b])
    assert x.tolist() == [11.0, 21.0, 30.0]
    assert mean.tolist() == [2.0, 4.0, 7.0]
    assert std.tolist() == pytest.approx([2 ** 0.5, 2 ** 0.5, 0.0])
    x, mean, _ = group_curve([(a[0], None), (b[0], None)])  # no x metric: the step is the x
    assert x.tolist() == [0.0, 1.0, 2.0] and mean.tolist() == [2.0, 4.0, 7.0]


def test_rollout_scores_by_mode_weights_each_iteration_by_its_episodes():
    from empo2.compare import rollout_scores_by_mode

    history = [{"iteration": 0, "rollout/episodes_memory": 2.0, "rollout/score_memory": 0.5,
                "rollout/episodes_tipfree": 6.0, "rollout/score_tipfree": 0.25},
               {"iteration": 1, "rollout/episodes_memory": 6.0, "rollout/score_memory": 0.75},
               {"iteration": 1, "val/score_nomem": 0.9}]  # a validation row: no rollout in either mode
    # memory: (2 x 0.5 + 6 x 0.75) / 8 = 5.5 / 8, not the plain mean 0.625 of the two iterations
    assert rollout_scores_by_mode(history) == {"memory": (0.6875, 8), "tipfree": (0.25, 6)}
    assert rollout_scores_by_mode(history[1:]) == {"memory": (0.75, 6), "tipfree": None}
    assert rollout_scores_by_mode([]) == {"memory": None, "tipfree": None}


def test_paired_difference_is_taken_over_the_seeds_both_groups_ran():
    from empo2.compare import paired_difference
    from empo2.stats import bootstrap_ci

    group, baseline = {"0": 5.0, "1": 7.0, "2": 9.0}, {"0": 4.0, "1": 4.0, "2": 10.0, "3": 1.0}
    mean, low, high, n = paired_difference(group, baseline)  # differences 1, 3, -1; seed 3 has no pair
    assert (mean, n) == (1.0, 3) and (low, high) == bootstrap_ci([1.0, 3.0, -1.0])[1:]
    shuffled = dict(reversed(list(group.items())))  # the order runs come in changes nothing
    assert paired_difference(shuffled, baseline) == (mean, low, high, n)
    shifted = {s: v + 2.0 for s, v in group.items()}  # a constant shift moves the interval by the same amount
    assert paired_difference(shifted, baseline)[:3] == pytest.approx((3.0, low + 2.0, high + 2.0))
    one = paired_difference({"0": 5.0}, baseline)
    assert one[0] == 1.0 and one[3] == 1 and math.isnan(one[1]) and math.isnan(one[2])
    none = paired_difference({"7": 5.0}, baseline)
    assert math.isnan(none[0]) and none[3] == 0
