"""Presets, grid files and sweep files: composition, the settings each preset stands for, and the
one-line errors for bad input."""

import dataclasses
import math

import pytest

from empo2.config import ConfigError, load_config
from empo2.config.experiments import available_presets
from empo2.workflows.evaluate import parse_kv
from empo2.workflows.grid import parse_seeds, plan_grid
from empo2.workflows.sweep import load_sweep

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


# The released code's values (microsoft/agent-lightning 0b40cb72 [A], agent-lightning/agl-envs 4fa0c58 [E],
# verl v0.5.0 defaults [V]); experiments/empo2_official.yaml cites each one's line, docs/official_preset.md tabulates.
RELEASED = {
    "algo.p": 0.25, "algo.q": 0.68, "algo.mode_granularity": "batch",  # [A] trainer.py:309-318
    "algo.mask_mode": "sequence", "algo.mask_scope": "all", "algo.mask_logprobs": "behaviour",  # core_empo2.py:51-68
    "algo.delta": 0.0,  # USE_LOW_PROB_MASKING false, recipe:14
    "algo.intrinsic": "retrieval", "algo.intrinsic_in_advantage": False,  # agent:136-148; trainer.py:420-449
    "algo.beta_start": 1.0, "algo.beta_end": 1.0, "algo.beta_schedule": "constant",
    "algo.clip_low": 0.2, "algo.clip_high": 0.3, "algo.dual_clip_c": 10.0,  # recipe:65-67
    "algo.kl_coef": 0.0, "algo.entropy_coef": 0.0, "algo.normalize_std": True, "algo.adv_eps": 1e-6,
    "algo.loss_agg": "seq-mean-token-mean",  # [V] token-mean per 1-sample micro-batch, / gradient accumulation
    "trainer.mini_batch_size": 128, "trainer.micro_batch_size": 1,  # recipe:6-9 x [V] fsdp_workers.py:175-176
    "trainer.iterations": 10000,  # 500 epochs x 320 rows / 16 (recipe:93, 34; [E] data:9-11)
    "trainer.lr": 1e-6, "trainer.weight_decay": 0.01, "trainer.grad_clip": 1.0, "trainer.ppo_epochs": 1,
    "trainer.val_every": 20, "trainer.ckpt_every": 50, "trainer.val_before_train": False,
    "rollout.tasks_per_batch": 16, "rollout.group_size": 8, "rollout.temperature": 1.0,
    "rollout.val_temperature": 0.4, "rollout.max_new_tokens": 32, "rollout.max_prompt_tokens": 4500,
    "rollout.tip_max_new_tokens": 512, "rollout.tip_temperature": 1.0, "rollout.history_turns": None,
    "rollout.tips_in_history": True, "rollout.prompt_template": "released", "rollout.overlong": "drop",
    "memory.top_k": 10, "memory.min_sim": 0.5, "memory.capacity": 1000, "memory.namespace": "variation",
    "memory.eviction": "oldest", "memory.per_step_entries": True, "memory.step_entry_key": "final",
    "memory.key_text": "history", "memory.rank_by": "score", "memory.tip_format": "raw",
    "env.name": "scienceworld", "env.tasks": ["power-component"], "env.train_variations": 5,
    "env.val_split": "test", "env.val_variations": 20, "env.val_repeats": 4, "env.simplification": "easy",
    "env.max_steps": None, "env.action_correction": True, "env.reward_scale": 1.0, "env.clamp_score": False,
    "model.name": "qwen2.5-7b-instruct",
}


def test_official_preset_resolves_to_the_released_values():
    cfg = _cfg("empo2_official")
    resolved = {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) for key in RELEASED}
    assert resolved == RELEASED
    # the paper preset keeps the paper's intent where the released code departs from it
    paper = _cfg("empo2_paper")
    assert (paper.algo.intrinsic, paper.algo.intrinsic_in_advantage, paper.env.clamp_score) == ("novelty", True, True)
    assert (paper.rollout.prompt_template, paper.memory.tip_format, paper.rollout.overlong) == \
        ("project", "line", "truncate")


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
    from empo2.workflows.compare import group_curve

    a = ({0: 1.0, 1: 3.0}, {0: 10.0, 1: 22.0})
    b = ({0: 3.0, 1: 5.0, 2: 7.0}, {0: 12.0, 1: 20.0, 2: 30.0})
    x, mean, std = group_curve([a, b])
    assert x.tolist() == [11.0, 21.0, 30.0]
    assert mean.tolist() == [2.0, 4.0, 7.0]
    assert std.tolist() == pytest.approx([2 ** 0.5, 2 ** 0.5, 0.0])
    x, mean, _ = group_curve([(a[0], None), (b[0], None)])  # no x metric: the step is the x
    assert x.tolist() == [0.0, 1.0, 2.0] and mean.tolist() == [2.0, 4.0, 7.0]


def test_paired_difference_is_taken_over_the_seeds_both_groups_ran():
    from empo2.workflows.compare import paired_difference

    group, baseline = {"0": 5.0, "1": 7.0, "2": 9.0}, {"0": 4.0, "1": 4.0, "2": 10.0, "3": 1.0}
    mean, low, high, n = paired_difference(group, baseline)  # differences 1, 3, -1; seed 3 has no pair
    # the paired t-interval: s = 2, se = 2 / sqrt(3), t_{0.975, 2} = 4.303 -> 1 -/+ 4.969
    assert (mean, n) == (1.0, 3) and (low, high) == pytest.approx((1 - 4.969, 1 + 4.969), abs=1e-3)
    shuffled = dict(reversed(list(group.items())))  # the order runs come in changes nothing
    assert paired_difference(shuffled, baseline) == (mean, low, high, n)
    shifted = {s: v + 2.0 for s, v in group.items()}  # a constant shift moves the interval by the same amount
    assert paired_difference(shifted, baseline)[:3] == pytest.approx((3.0, low + 2.0, high + 2.0))
    one = paired_difference({"0": 5.0}, baseline)
    assert one[0] == 1.0 and one[3] == 1 and math.isnan(one[1]) and math.isnan(one[2])
    none = paired_difference({"7": 5.0}, baseline)
    assert math.isnan(none[0]) and none[3] == 0
