"""Presets, grid files and sweep files: composition (as Hydra's `experiment` group, unchanged from the former
override lists), the settings each preset stands for, and the one-line errors for bad input."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from empo2.config import ConfigError, load_config, to_dict
from empo2.config.experiments import EXPERIMENTS_DIR, HEADER, available_presets, preset_descriptions, read_yaml
from empo2.workflows.evaluate import parse_kv
from empo2.workflows.grid import parse_seeds, plan_grid
from empo2.workflows.sweep import load_sweep

ROOT = Path(__file__).resolve().parents[2]
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
    assert (gpu.env.name, gpu.model.name, gpu.trainer.strategy) == ("scienceworld", "qwen2.5-7b", "fsdp")
    assert (cpu.env.name, cpu.model.name, cpu.trainer.accelerator) == ("minisci", "smollm2", "cpu")
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
    "model.name": "qwen2.5-7b",
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


# Every preset as it was before presets became Hydra configs: `base:` presets whose overrides come first, then
# `overrides:`, expanded by our own parser into one override list (`former_overrides` below is that parser).
FORMER = ROOT / "tests" / "data" / "former_presets"


def former_overrides(name: str) -> list[str]:
    data = yaml.safe_load((FORMER / f"{name}.yaml").read_text())
    bases = [data["base"]] if isinstance(data.get("base"), str) else data.get("base", [])
    return [o for base in bases for o in former_overrides(base)] + data.get("overrides", [])


def _plain(cfg) -> dict:
    return json.loads(json.dumps(to_dict(cfg), default=str))


@pytest.mark.parametrize("preset", sorted(p.stem for p in FORMER.glob("*.yaml")))
def test_every_preset_composes_the_config_its_former_override_list_composed(preset):
    """The resolved config of each preset equals that of its former override list, but for the run's record of
    the preset (`experiment`, `description`: each preset describes itself in one line)."""
    config, former = _plain(_cfg(preset)), _plain(load_config(former_overrides(preset)))
    assert config.pop("experiment") == preset and former.pop("experiment") is None
    description = config.pop("description")
    assert config == {k: v for k, v in former.items() if k != "description"}
    assert isinstance(description, str) and description.strip() and "\n" not in description


def test_no_preset_was_lost_and_every_file_of_experiments_is_a_hydra_preset():
    assert set(available_presets()) >= {p.stem for p in FORMER.glob("*.yaml")}
    for name in available_presets():
        text = (EXPERIMENTS_DIR / f"{name}.yaml").read_text()
        data = read_yaml(EXPERIMENTS_DIR / f"{name}.yaml", "preset")
        assert text.startswith(HEADER + "\n") and not set(data) & {"base", "overrides", "presets"}, name
        assert data["defaults"][-1] == "_self_" and len(data["description"]) <= 110, name
    assert all("presets" in read_yaml(p, "grid") for p in (ROOT / "grids").glob("*.yaml"))


def test_the_cpu_sized_scienceworld_preset_is_empo2_paper_on_short_tasks_with_the_laptop_model():
    cfg = load_config(["experiment=empo2_paper_scienceworld_cpu"])
    paper = load_config(["experiment=empo2_paper"])
    assert cfg.algo == paper.algo and cfg.memory == paper.memory  # the paper's method, as the GPU preset has it
    assert (cfg.env.name, cfg.model.name, cfg.engine.name, cfg.trainer.accelerator) == ("scienceworld", "smollm2",
                                                                                        "hf", "cpu")
    assert cfg.env.tasks == ["lifespan-longest-lived", "lifespan-shortest-lived",
                             "lifespan-longest-lived-then-shortest-lived"]
    assert (cfg.trainer.iterations, cfg.trainer.val_every, cfg.trainer.val_before_train) == (12, 4, True)


FORMER_BEST = """# Best trial 3 of Optuna study 'empo2-minisci': val/score_nomem = 0.4 (maximize).
base: empo2_paper_minisci
overrides:
- trainer.iterations=20
- trainer.val_every=5
- algo.p=0.3
- algo.q=0.5
- algo.delta=0.001
- algo.beta_start=1.0
- algo.beta_end=0.1
- algo.mode_granularity=step
"""


def _former_best() -> dict:
    """FORMER_BEST's config as the former parser composed it: its base's override list, then its own."""
    own = yaml.safe_load(FORMER_BEST)["overrides"]
    config = _plain(load_config(former_overrides("empo2_paper_minisci") + own))
    return {k: v for k, v in config.items() if k not in ("experiment", "description")}


def test_a_best_yaml_in_the_former_format_still_loads_through_the_migration(tmp_path):
    path = tmp_path / "best.yaml"
    path.write_text(FORMER_BEST)
    config = _plain(load_config([f"experiment={path}"]))
    assert config.pop("experiment") == str(path)
    assert config.pop("description") == preset_descriptions()["empo2_paper_minisci"]  # the base's: it has none
    assert config == _former_best()


def test_a_sweep_writes_its_best_trial_as_a_hydra_preset_that_composes_as_the_former_file(tmp_path):
    import optuna

    from empo2.workflows.sweep import _write_best

    sweep = tmp_path / "s.yaml"
    sweep.write_text("study: s\npreset: empo2_paper_minisci\noverrides: [trainer.iterations=20, trainer.val_every=5]\n"
                     "space:\n  algo.p: {type: float, low: 0.1, high: 0.6}\n"
                     "  algo.q: {type: float, low: 0.0, high: 1.0}\n"
                     "  algo.delta: {type: float, low: 1.0e-4, high: 0.1, log: true}\n"
                     "  algo.beta_start: {type: float, low: 0.0, high: 1.5}\n"
                     "  algo.beta_end: {type: float, low: 0.0, high: 0.5}\n  algo.mode_granularity: [step, episode]\n")
    spec = load_sweep(sweep)
    study = optuna.create_study(direction="maximize")
    params = {"algo.p": 0.3, "algo.q": 0.5, "algo.delta": 0.001, "algo.beta_start": 1.0, "algo.beta_end": 0.1,
              "algo.mode_granularity": "step"}
    distributions = {"algo.mode_granularity": optuna.distributions.CategoricalDistribution(["step", "episode"])}
    distributions |= {k: optuna.distributions.FloatDistribution(0.0001, 1.5) for k in params if k not in distributions}
    study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, value=0.4))
    best = tmp_path / "best.yaml"
    _write_best(study, spec, best)
    text = best.read_text()
    assert text.startswith(HEADER + "\n") and "/experiment/empo2_paper_minisci" in text and "base:" not in text
    config = _plain(load_config([f"experiment={best}"]))
    assert config.pop("description") == "best trial 0 of Optuna study s: val/score_nomem = 0.4"
    assert config.pop("experiment") == str(best)
    assert config == _former_best()


def test_a_preset_file_builds_on_presets_and_chooses_groups_through_its_defaults_list(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(f"{HEADER}\ndescription: mine\ndefaults:\n  - /experiment/grpo_minisci\n"
                    "  - override /model: tiny\n  - _self_\nalgo:\n  p: 0.1\n")
    cfg = load_config([f"experiment={path}", "algo.q=0.2"])
    assert (cfg.algo.p, cfg.algo.q, cfg.algo.name, cfg.model.name, cfg.memory.enabled) == (0.1, 0.2, "grpo", "tiny",
                                                                                           False)
    assert (cfg.experiment, cfg.description) == (str(path), "mine")
    assert load_config(["experiment=null"]).experiment is None
    path.write_text("description: no header\nalgo:\n  p: 0.1\n")
    with pytest.raises(ConfigError, match="a preset starts with the line `# @package _global_`"):
        load_config([f"experiment={path}"])


def test_config_experiment_lists_every_preset_with_its_description():
    from empo2.config import describe

    listing = describe("experiment").splitlines()
    for name, description in preset_descriptions().items():
        assert any(line.split()[:1] == [name] and line.endswith(description) for line in listing), name
    assert "experiment" in describe() and "grpo_minisci" in describe()


def test_a_finished_grid_run_resumes_across_the_description_field_but_not_across_a_setting(tmp_path):
    from empo2.workflows.grid import is_finished

    grid = tmp_path / "g.yaml"
    grid.write_text("presets: [grpo_minisci]\n")
    (run,) = plan_grid(grid, overrides=[f"run_root={tmp_path}"])[1]
    saved = _plain(run.cfg)
    del saved["description"]  # a run finished before presets had one
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "summary.json").write_text(json.dumps({"config": saved}))
    assert is_finished(run)
    saved["algo"]["p"] = 0.5
    (run.run_dir / "summary.json").write_text(json.dumps({"config": saved}))
    with pytest.raises(ConfigError, match="algo.p=0.5"):
        is_finished(run)



def test_a_run_saved_before_presets_had_a_description_still_loads_for_eval(tmp_path):
    from empo2.workflows.evaluate import run_config

    saved = _plain(_cfg("grpo_minisci"))
    del saved["description"]  # a run's config as it was saved before presets had one
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "summary.json").write_text(json.dumps({"config": saved}))
    cfg = run_config(tmp_path / "checkpoints" / "last.ckpt", ["env.val_variations=3"])
    assert (cfg.experiment, cfg.description, cfg.algo.name, cfg.env.val_variations) == ("grpo_minisci", None, "grpo", 3)

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
    (f"experiment={ROOT / 'grids' / 'ablations.yaml'}", "is a grid"),
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


def test_a_grid_file_at_its_old_place_names_the_new_one(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=r"^grid file experiments/ablations.yaml: no such file; it moved to "
                                          r"grids/ablations.yaml$"):
        plan_grid("experiments/ablations.yaml")


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


def test_a_sweep_file_naming_a_renamed_metric_optimises_it_under_its_new_name(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SWEEP_HEAD + "metric: rollout/score_tipfree\nspace:\n  algo.p: [0.1]\n")
    assert load_sweep(path).metric == "rollout/score_nomem"


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
