import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from empo2.config import CONF_DIR, GROUPS, ConfigError, TrainConfig, load_config, validate

YAML_FILES = sorted(p.relative_to(CONF_DIR) for p in CONF_DIR.rglob("*.yaml") if p.name != "train.yaml")


def test_defaults_compose_and_dataclass_defaults_are_the_paper_values():
    assert isinstance(load_config([]), TrainConfig)
    cfg = TrainConfig()  # YAML defaults are CPU-sized; the documented field defaults follow the paper
    assert (cfg.algo.p, cfg.algo.q, cfg.algo.delta) == (0.25, 0.68, 0.01)
    assert (cfg.algo.beta_start, cfg.algo.beta_end) == (0.8, 0.2)
    assert (cfg.memory.top_k, cfg.memory.min_sim, cfg.memory.max_tip_words) == (10, 0.5, 100)
    assert (cfg.rollout.group_size, cfg.rollout.temperature, cfg.rollout.val_temperature) == (8, 1.0, 0.4)


@pytest.mark.parametrize("rel", YAML_FILES, ids=str)
def test_every_group_option_composes_and_instantiates(rel):
    group, option = rel.parts[0], rel.stem
    overrides = [f"{group}={option}"]
    if group == "model" and option != "tiny" and option != "smollm2":
        overrides.append("model.path=/models/some-checkpoint")
    cfg = load_config(overrides)
    assert isinstance(getattr(cfg, group), typing.get_type_hints(TrainConfig)[group])


def test_every_field_is_documented():
    for group in GROUPS:
        for f in dataclasses.fields(getattr(TrainConfig(), group)):
            assert len(f.metadata.get("help", "")) > 10, f"{group}.{f.name} has no documentation"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("algo.p=1.5", "algo.p=1.5 is out of range: expected [0, 1]"),
        ("algo.q=-0.1", "algo.q=-0.1 is out of range: expected [0, 1]"),
        ("algo.delta=1.0", "algo.delta=1.0 is out of range: expected [0, 1)"),
        ("algo.beta_start=-1", "algo.beta_start=-1.0 is out of range: expected [0, inf)"),
        ("rollout.group_size=1", "rollout.group_size=1 is out of range: expected [2, inf)"),
        ("memory.top_k=0", "memory.top_k=0 is out of range: expected [1, inf)"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens=0 is out of range: expected (0, inf)"),
        ("trainer.micro_batch_tokens=0", "trainer.micro_batch_tokens=0 is out of range: expected (0, inf)"),
        ("trainer.micro_batch_tokens=lots", "trainer.micro_batch_tokens"),
        ("algo.mask_mode=word", "algo.mask_mode='word' is not allowed: expected one of ['token', 'sequence']"),
        ("algo.intrinsic=visits", "algo.intrinsic='visits' is not allowed: expected one of ['novelty', 'retrieval']"),
        ("algo.mask_logprobs=old", "algo.mask_logprobs='old' is not allowed: expected one of ['learner', 'behaviour']"),
        ("env.val_repeats=0", "env.val_repeats=0 is out of range: expected (0, inf)"),
        ("env.clamp_score=false", "env.clamp_score=False is not allowed with env.name=minisci"),
        ("memory.tip_format=raw", "memory.tip_format=raw is not allowed with rollout.prompt_template=project"),
        ("rollout.prompt_template=verl", "rollout.prompt_template='verl' is not allowed"),
        ("rollout.overlong=cut", "rollout.overlong='cut' is not allowed: expected one of ['truncate', 'drop']"),
        ("algo.p=abc", "algo.p"),
        ("algo.foo=1", "algo.foo: unknown key"),
        ("+algo.foo=1", "algo.foo: unknown key"),
        ("+bar=1", "bar: unknown key"),
        ("model.gradient_checkpointing=true", "model.gradient_checkpointing: no longer a key; use "
                                              "trainer.gradient_checkpointing"),
        ("trainer.val_memory=true", "trainer.val_memory: no longer a key; use trainer.val_mem"),
        ("model.name=minisci-tips-signed", "model.name=minisci-tips-signed: no longer a name; use "
                                           "model.name=minisci_tips_signed"),
    ],
)
def test_bad_values_raise_one_line_naming_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg


def test_validation_repeats_play_each_held_out_instance_that_many_times():
    from empo2.rollout.build import validation_tasks

    once = validation_tasks(load_config(["env.val_variations=2"]))
    four = validation_tasks(load_config(["env.val_variations=2", "env.val_repeats=4"]))
    assert len(four) == 4 * len(once) and [t for t in four[::4]] == once and four[:4] == [once[0]] * 4
    # the training instances of trainer.val_train are not repeated
    assert validation_tasks(load_config(["env.val_repeats=4"]), on_train=True) == validation_tasks(load_config([]),
                                                                                                  on_train=True)


def test_laptop_memory_defaults_are_on_in_one_cpu_process_and_off_on_gpus_many_processes_and_the_small_priors():
    """`empo2 train` fits a laptop (gradient checkpointing, a 1280-token micro-batch cap, the allocator trimmed);
    the GPU and multi-process trainer presets, and the presets of the 0.7M-parameter MiniSci priors (whose
    recorded runs the demo repeats), keep the faster update."""
    t = load_config([]).trainer
    assert (t.gradient_checkpointing, t.micro_batch_tokens, t.release_memory) == (True, 1280, True)
    for overrides in (["trainer=gpu"], ["trainer=fsdp"], ["trainer=ddp"], ["experiment=empo2_paper_minisci_tips"]):
        t = load_config(overrides).trainer
        assert (t.gradient_checkpointing, t.micro_batch_tokens, t.release_memory) == (False, None, False), overrides
    # the 7B model preset composes after the trainer group: its long histories keep gradient checkpointing on GPUs
    for overrides in (["experiment=empo2_paper"], ["model=qwen2.5-7b", "trainer=fsdp"]):
        t = load_config(overrides).trainer
        assert (t.gradient_checkpointing, t.micro_batch_tokens, t.release_memory) == (True, None, False), overrides
    assert load_config(["trainer.micro_batch_tokens=4096"]).trainer.micro_batch_tokens == 4096
    assert load_config(["trainer.micro_batch_tokens=null"]).trainer.micro_batch_tokens is None


def test_cross_field_rule_micro_batch_fits_mini_batch():
    cfg = TrainConfig()
    cfg.trainer.micro_batch_size = cfg.trainer.mini_batch_size + 1
    with pytest.raises(ConfigError, match="trainer.micro_batch_size"):
        validate(cfg)


def test_minisci_house_settings_reach_the_env_and_are_refused_for_other_envs():
    from empo2.rollout.build import env_kwargs

    kw = env_kwargs(load_config(["env.num_rooms=4", "env.num_decoys=0", "env.hide_prob=0.5"]))
    assert (kw["num_rooms"], kw["num_decoys"], kw["hide_prob"], kw["num_distractors"]) == (4, 0, 0.5, 2)
    assert "num_rooms" not in env_kwargs(load_config(["env=scienceworld"]))
    with pytest.raises(ConfigError, match=r"^env.num_decoys=0 is not allowed with env.name=scienceworld: it is a "
                                          r"setting of env.name=minisci \(env=minisci\)$"):
        load_config(["env=scienceworld", "env.num_decoys=0"])


def test_minisci_tips_runs_only_on_the_prompt_layout_it_was_trained_on():
    cfg = load_config(["model=minisci_tips"])  # the preset selects rollout=whole_chat
    assert cfg.rollout.history_turns is None and cfg.rollout.tips_in_history
    from recipes.minisci_priors.prior_tips import MAX_PROMPT_TOKENS  # the budget it was trained within

    assert cfg.rollout.max_prompt_tokens == cfg.rollout.max_tip_request_tokens == MAX_PROMPT_TOKENS
    assert load_config(["model=minisci_tips", "rollout.max_new_tokens=5"]).rollout.history_turns is None
    assert load_config(["model=smollm2"]).rollout.history_turns == 2
    with pytest.raises(ConfigError, match=r"^rollout.history_turns=2 is not allowed with model.name=minisci_tips"):
        load_config(["model=minisci_tips", "rollout.history_turns=2"])
    with pytest.raises(ConfigError, match=r"^rollout.tips_in_history=False is not allowed with model.name=minisci"):
        load_config(["model=minisci_tips", "rollout=whole_chat", "rollout.tips_in_history=false"])


def test_a_checkpoint_that_records_its_prompt_layout_is_held_to_it(tmp_path):
    """A fine-tuned copy of minisci_tips loaded as `model.name=hf` keeps the layout it was trained on, even under
    a preset that sets another (the paper's): the layout comes from the checkpoint's own marker."""
    from empo2.config.presets import MINISCI_TIPS_LAYOUT

    (tmp_path / "empo2_source.json").write_text(json.dumps({"prompt_layout": MINISCI_TIPS_LAYOUT}))
    hf = ["model.name=hf", f"model.path={tmp_path}", "rollout=whole_chat"]
    assert load_config(hf).rollout.tips_in_history
    with pytest.raises(ConfigError, match=r"^rollout.tips_in_history=False is not allowed with model.path="):
        load_config(["experiment=empo2_paper_minisci", *hf])  # the preset's value wins over the group's
    with pytest.raises(ConfigError, match=r"^rollout.history_turns=2 is not allowed with model.path="):
        load_config([*hf, "rollout.history_turns=2"])
    (tmp_path / "empo2_source.json").write_text(json.dumps({"gguf": "x"}))  # a marker without a layout
    plain = load_config(["model.name=hf", f"model.path={tmp_path}", "rollout.history_turns=2"])
    assert plain.rollout.history_turns == 2


def test_nan_is_rejected():
    cfg = TrainConfig()
    cfg.algo.beta_end = float("nan")
    with pytest.raises(ConfigError, match="algo.beta_end=nan"):
        validate(cfg)


def test_cli_exits_2_with_one_line_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "empo2.cli", "train", "algo.p=1.5", f"run_root={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "algo.p" in lines[0] and "[0, 1]" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not any(Path(tmp_path).iterdir())  # no run folder was created


def test_cli_help_lists_subcommands():
    proc = subprocess.run([sys.executable, "-m", "empo2.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for name in ("train", "eval", "adapt", "grid", "sweep", "compare", "models"):
        assert name in proc.stdout


def test_fp16_precision_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"^trainer.precision=16-mixed is not supported: fp16 loss scaling") as e:
        load_config(["trainer.precision=16-mixed"])
    assert "\n" not in str(e.value)
    assert load_config(["trainer.precision=bf16-mixed"]).trainer.precision == "bf16-mixed"


def test_bf16_true_precision_is_refused_with_the_reason():
    """bfloat16 weights and optimizer state: small updates round away (tests/integration/test_master_weights.py)."""
    with pytest.raises(ConfigError, match=r"^trainer.precision=bf16-true is not supported: it trains bfloat16 "
                                          r"weights.*use bf16-mixed") as e:
        load_config(["trainer.precision=bf16-true"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, exact", [
    ([], True),
    (["rollout.generation_logprobs=false"], False),
    # a bfloat16 update: two bfloat16 passes of different shapes differ by bfloat16 rounding
    (["trainer.precision=bf16-mixed"], False),
    (["trainer.precision=bf16-mixed", "engine.dtype=float32"], False),
    # model.dtype names only how the weights are read (master weights are float32): it decides nothing here
    (["model.dtype=bfloat16"], True),
    (["engine.dtype=bfloat16"], False),  # HF generate under bfloat16 autocast, a float32 update
    (["engine.name=vllm"], True),  # weights synced before each rollout; float32 gap bounded in test_vllm.py
    (["engine.name=vllm", "engine.dtype=bfloat16"], False),  # another engine's bfloat16 kernels differ by more
    (["engine.name=vllm", "rollout.top_p=0.9"], False),  # vLLM's log-probs renormalised over the nucleus
    (["rollout.top_p=0.9"], False),
])
def test_generation_logprobs_are_taken_only_where_they_are_the_scored_distribution(overrides, exact):
    from empo2.rollout.build import generation_logprobs_exact

    assert generation_logprobs_exact(load_config(["model=tiny", *overrides])) is exact


@pytest.mark.parametrize("overrides, dtype", [
    ([], "float32"),
    (["trainer.precision=bf16-mixed"], "bfloat16"),
    (["model.dtype=bfloat16"], "float32"),  # the dtype weights are read in is not the compute precision
    (["trainer.precision=bf16-mixed", "engine.dtype=float32"], "float32"),
    (["engine.dtype=float16"], "float16"),
])
def test_engine_dtype_auto_is_the_trainers_compute_precision(overrides, dtype):
    from empo2.rollout.build import engine_dtype

    assert engine_dtype(load_config(["model=tiny", *overrides])) == dtype


def test_engine_logprobs_are_recorded_with_vllm_whatever_the_nucleus_and_with_hf_without_one():
    from empo2.rollout.build import records_engine_logprobs

    assert records_engine_logprobs(load_config(["engine.name=vllm", "rollout.top_p=0.9"]))
    assert records_engine_logprobs(load_config(["engine.name=vllm", "trainer.precision=bf16-mixed"]))
    assert records_engine_logprobs(load_config(["trainer.precision=bf16-mixed"]))
    assert not records_engine_logprobs(load_config(["rollout.top_p=0.9"]))  # HF reads the whole vocabulary


def test_the_largest_request_is_the_action_prompt_with_its_tips_or_the_tip_request_by_hand():
    from empo2.rollout.build import TIP_HEADER_TOKENS, TIP_LINE_TOKENS, max_request_tokens

    base = ["rollout.max_prompt_tokens=1000", "rollout.max_new_tokens=32", "rollout.tip_max_new_tokens=160",
            "memory.top_k=10", "rollout.max_tip_request_tokens=null"]
    # 1000 + 32 + 10 x (160 + 32) + 32 = 2984 against the tip request's 1000 + 160
    assert TIP_LINE_TOKENS == 32 and TIP_HEADER_TOKENS == 32
    assert max_request_tokens(load_config(base)) == 1000 + 32 + 10 * (160 + 32) + 32
    # per-step entries carry their step's action: + 32 per tip
    assert max_request_tokens(load_config(base + ["memory.per_step_entries=true"])) == 2984 + 10 * 32
    assert max_request_tokens(load_config(base + ["memory.enabled=false"])) == 1000 + 160  # the tip request
    assert max_request_tokens(load_config(base + ["memory.enabled=false", "rollout.max_tip_request_tokens=3000"])) \
        == 3160
    assert max_request_tokens(load_config(base + ["rollout.overlong=drop"])) is None
    assert max_request_tokens(load_config(base + ["rollout.tips_in_history=true"])) is None


def test_a_tis_cap_that_cannot_weigh_anything_is_refused():
    with pytest.raises(ConfigError, match=r"^algo.tis_cap=2.0 has no effect with engine.name=hf and rollout.top_p=0.9"):
        load_config(["algo.tis_cap=2", "rollout.top_p=0.9"])
    assert load_config(["algo.tis_cap=2"]).algo.tis_cap == 2.0  # top_p = 1: HF records every token's log-prob


@pytest.mark.parametrize("unbounded", ["rollout.overlong=drop", "rollout.tips_in_history=true"])
def test_vllm_needs_an_explicit_max_model_len_where_prompts_are_unbounded(unbounded):
    with pytest.raises(ConfigError, match=rf"^engine.max_model_len is required with engine.name=vllm and "
                                          rf"{unbounded}") as e:
        load_config(["engine=vllm", unbounded])
    assert "\n" not in str(e.value)
    assert load_config(["engine=vllm", unbounded, "engine.max_model_len=8192"]).engine.max_model_len == 8192
    assert load_config([unbounded]).engine.max_model_len is None  # the HF engine has no cap
    with pytest.raises(ConfigError, match="engine.max_model_len=0 is out of range"):
        load_config(["engine.max_model_len=0"])


def test_tis_cap_is_off_by_default_and_at_least_one():
    assert load_config([]).algo.tis_cap is None
    assert load_config(["algo.tis_cap=2"]).algo.tis_cap == 2
    with pytest.raises(ConfigError, match=r"algo.tis_cap=0.5 is out of range: expected \[1, inf\)"):
        load_config(["algo.tis_cap=0.5"])


def test_gradient_checkpointing_is_the_trainers_knob_and_the_7b_preset_turns_it_on():
    assert not hasattr(TrainConfig().model, "gradient_checkpointing")
    assert load_config(["model=qwen2.5-7b"]).trainer.gradient_checkpointing
    assert not load_config(["model=qwen2.5-7b", "trainer.gradient_checkpointing=false"]).trainer.gradient_checkpointing


def test_a_saved_config_with_old_keys_migrates_to_todays():
    from empo2.config import migrate_config

    saved = {"model": {"name": "tiny", "gradient_checkpointing": True},
             "trainer": {"gradient_checkpointing": False, "val_memory": True}}
    assert migrate_config(saved) == {"model": {"name": "tiny"},
                                     "trainer": {"gradient_checkpointing": True, "val_mem": True}}
    assert saved["model"]["gradient_checkpointing"]  # the saved dict itself is left as it was
    both_off = {"model": {"gradient_checkpointing": False}, "trainer": {"gradient_checkpointing": False}}
    assert migrate_config(both_off)["trainer"] == {"gradient_checkpointing": False}


def test_a_preset_has_one_name_its_option_its_model_name_and_its_folder():
    from empo2.config import group_options
    from empo2.config.presets import PRESETS
    from empo2.models.io import RECIPE_BUILT, SHIPPED

    assert set(PRESETS) == set(group_options("model"))
    for option in group_options("model"):
        assert load_config([f"model={option}", "model.path=/x"]).model.name == option
    assert {p.name for p in PRESETS.values() if p.source == "asset"} == {d.name for d in SHIPPED.iterdir()
                                                                          if d.is_dir()}
    assert {p.name for p in PRESETS.values() if p.source == "recipe"} == set(RECIPE_BUILT)


def test_a_presets_former_name_maps_to_todays_and_is_refused_on_the_command_line():
    from empo2.config import RENAMED_MODELS, current_model, migrate_config
    from empo2.config.presets import PRESETS

    assert RENAMED_MODELS["minisci-tips-signed"] == "minisci_tips_signed"
    assert RENAMED_MODELS["qwen2.5-7b-instruct"] == "qwen2.5-7b"
    assert RENAMED_MODELS["smollm2-135m-instruct"] == "smollm2"
    assert set(RENAMED_MODELS.values()) <= set(PRESETS) and not set(RENAMED_MODELS) & set(PRESETS)
    assert current_model("minisci-bc") == "minisci_bc" and current_model("tiny") == "tiny"
    saved = {"model": {"name": "minisci-tips-reader", "dtype": "float32"}}
    assert migrate_config(saved) == {"model": {"name": "minisci_tips_reader", "dtype": "float32"}}
    assert saved["model"]["name"] == "minisci-tips-reader"  # the saved dict itself is left as it was
    for old, new in RENAMED_MODELS.items():
        with pytest.raises(ConfigError, match=rf"^model.name={old}: no longer a name; use model.name={new}$"):
            load_config([f"model.name={old}", "model.path=/x"])


def test_a_run_saved_under_a_presets_former_name_evaluates_and_its_grid_resumes(tmp_path):
    """`model.name: minisci-tips-signed` in a summary.json written before each preset took its option's name:
    `empo2 eval` reads it as `minisci_tips_signed`, and a grid asking for `model=minisci_tips_signed` counts the run
    as finished."""
    from empo2.config import to_dict
    from empo2.workflows.evaluate import run_config
    from empo2.workflows.grid import GridRun, is_finished

    wanted = ["model=minisci_tips_signed", "logger=none"]
    grid_cfg = load_config(wanted + [f"run_root={tmp_path}", "run_name=run"])
    saved = json.loads(json.dumps(to_dict(grid_cfg), default=str))
    saved["model"]["name"] = "minisci-tips-signed"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"config": saved}))
    assert run_config(run_dir / "checkpoints" / "last.ckpt", []).model.name == "minisci_tips_signed"
    assert is_finished(GridRun("p", 0, wanted, grid_cfg))
    with pytest.raises(ConfigError, match=r"^model.name=minisci-tips-signed: no longer a name; use "
                                          r"model.name=minisci_tips_signed$"):
        run_config(run_dir / "checkpoints" / "last.ckpt", ["model.name=minisci-tips-signed"])


SAVED_BY_MAIN = json.loads((Path(__file__).parent.parent / "data" / "saved_by_main" / "configs.json").read_text())


def test_each_env_option_brings_its_environments_own_config_class():
    from empo2.config import ENV_CONFIGS, MiniSciConfig, ScienceWorldConfig, TextWorldConfig

    for option, cls in (("minisci", MiniSciConfig), ("scienceworld", ScienceWorldConfig),
                        ("textworld", TextWorldConfig), ("textworld_treasure", TextWorldConfig)):
        cfg = load_config([f"env={option}"])
        assert type(cfg.env) is cls is ENV_CONFIGS[cfg.env.name]
    assert not hasattr(load_config(["env=scienceworld"]).env, "num_rooms")
    assert not hasattr(load_config([]).env, "simplification")
    for cls in ENV_CONFIGS.values():  # each environment's own fields are documented too
        assert all(len(f.metadata.get("help", "")) > 10 for f in dataclasses.fields(cls)), cls.__name__
    with pytest.raises(ConfigError, match=r"^env.simplification=hard is not allowed with env.name=textworld: it is "
                                          r"a setting of env.name=scienceworld \(env=scienceworld\)$"):
        load_config(["env=textworld", "env.simplification=hard"])
    with pytest.raises(ConfigError, match=r"^env.name=scienceworld is not allowed with the settings of "
                                          r"MiniSciConfig: .*\(env=scienceworld\)$"):
        load_config(["env.name=scienceworld"])


@pytest.mark.parametrize("env", ["scienceworld", "minisci"])
def test_a_run_folder_saved_by_an_earlier_version_evaluates_and_its_grid_resumes(tmp_path, env):
    """A summary.json written before the renames (model.gradient_checkpointing, trainer.val_memory, one env class
    holding every environment's fields): `empo2 eval` reads it into today's schema, and a grid asking for the same
    run in today's keys counts it as finished."""
    from empo2.config import to_dict
    from empo2.workflows.evaluate import run_config
    from empo2.workflows.grid import GridRun, is_finished

    saved = SAVED_BY_MAIN[env]
    assert "gradient_checkpointing" in saved["model"] and "num_rooms" in saved["env"]  # the old layout
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"config": saved}))
    cfg = run_config(run_dir / "checkpoints" / "last.ckpt", ["env.val_variations=2"])
    assert cfg.env.name == env and cfg.env.val_variations == 2
    if env == "scienceworld":
        assert cfg.trainer.gradient_checkpointing and cfg.trainer.val_mem and not hasattr(cfg.env, "num_rooms")
        wanted = ["env=scienceworld", "model=tiny", "trainer.gradient_checkpointing=true", "trainer.val_mem=true",
                  "logger=none"]
    else:
        assert cfg.env.num_rooms == 5 and not hasattr(cfg.env, "simplification")
        wanted = ["model=tiny", "env.num_rooms=5", "logger=none"]
    grid_cfg = load_config(wanted + [f"run_root={tmp_path}", "run_name=run"])
    (run_dir / "summary.json").write_text(json.dumps({"config": {**saved, "run_root": str(tmp_path),
                                                                 "run_name": "run"}}))  # as the grid saved it
    assert is_finished(GridRun("p", 0, wanted, grid_cfg))
    other = load_config(wanted + [f"run_root={tmp_path}", "run_name=run", "trainer.lr=0.5"])
    with pytest.raises(ConfigError, match="trainer.lr=1e-05 \\(this grid wants 0.5\\)"):
        is_finished(GridRun("p", 0, wanted, other))
    assert to_dict(cfg)["env"].keys() == to_dict(grid_cfg)["env"].keys()
