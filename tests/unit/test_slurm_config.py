"""The `--launcher slurm` job resources: read from `launcher.KEY=VALUE`, every bad key or value refused in one
line naming it, and turned into the sbatch options and run overrides a job needs. No cluster needed here
(tests/integration/test_cluster.py submits to a real one)."""

import dataclasses

import pytest

from empo2.cli import main
from empo2.config import ConfigError
from empo2.workflows.slurm import (
    SlurmConfig,
    _sbatch_options,
    job_parameters,
    load_slurm_config,
    run_overrides,
    split_overrides,
)


def test_launcher_overrides_are_split_from_the_run_overrides_and_read():
    ours, rest = split_overrides(["model=tiny", "launcher.partition=gpu", "launcher.gpus_per_node=8",
                                  "launcher.nodes=2", "launcher.extra=[--qos=high,--exclusive]", "seed=1"])
    assert rest == ["model=tiny", "seed=1"]
    cfg = load_slurm_config(ours)
    assert (cfg.partition, cfg.gpus_per_node, cfg.nodes) == ("gpu", 8, 2)
    # one rank per GPU on each node: Lightning checks these against the job's tasks
    assert run_overrides(cfg) == ["trainer.devices=8", "trainer.num_nodes=2"]
    assert _sbatch_options(cfg) == {"qos": "high", "exclusive": True}


def test_a_one_task_job_leaves_the_run_config_as_a_local_run_has_it():
    assert run_overrides(load_slurm_config([])) == []
    assert run_overrides(load_slurm_config(["launcher.gpus_per_node=1"])) == []
    assert job_parameters(load_slurm_config([]), "j")["ntasks_per_node"] == 1


def test_tasks_per_node_asks_for_that_many_ranks_on_a_cpu_node_and_one_per_gpu_by_default():
    cpu = load_slurm_config(["launcher.tasks_per_node=2"])
    assert run_overrides(cpu) == ["trainer.devices=2", "trainer.num_nodes=1"]
    params = job_parameters(cpu, "j")
    assert params["ntasks_per_node"] == 2 and "gpus_per_node" not in params  # no gres on a CPU cluster
    gpus = job_parameters(load_slurm_config(["launcher.gpus_per_node=4", "launcher.nodes=2"]), "j")
    assert (gpus["ntasks_per_node"], gpus["gpus_per_node"], gpus["nodes"]) == (4, 4, 2)
    assert job_parameters(load_slurm_config(["launcher.gpus_per_node=4", "launcher.tasks_per_node=4"]),
                          "j")["ntasks_per_node"] == 4


@pytest.mark.parametrize("override, message", [
    ("launcher.nodes=0", "launcher.nodes=0 is out of range: expected [1, inf)"),
    ("launcher.time=0", "launcher.time=0 is out of range: expected (0, inf)"),
    ("launcher.gpus_per_node=-1", "launcher.gpus_per_node=-1 is out of range"),
    ("launcher.cpus_per_task=two", "launcher.cpus_per_task: Value 'two' of type 'str' could not be converted"),
    ("launcher.mem_gb=0", "launcher.mem_gb=0 is out of range"),
    ("launcher.partion=gpu", "launcher.partion: unknown key (the fields: launcher.partition, "),
    ("launcher.extra=[qos=high]", "launcher.extra='qos=high' is not allowed: expected `--key=value` or `--flag`"),
    ("launcher.tasks_per_node=0", "launcher.tasks_per_node=0 is out of range: expected [1, inf)"),
    ("launcher.gpus_per_node=4 launcher.tasks_per_node=2",
     "launcher.tasks_per_node=2 does not match launcher.gpus_per_node=4: each task (rank) takes one GPU"),
])
def test_bad_launcher_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_slurm_config(override.split())
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_local_launcher_refuses_launcher_keys_and_every_field_is_documented(capsys, tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text('{"name": "g", "presets": ["grpo_minisci"]}')
    assert main(["grid", str(grid), "launcher.partition=gpu", "model=tiny"]) == 2
    assert "launcher.partition: unknown key" in capsys.readouterr().err
    assert main(["config", "launcher"]) == 0
    text = capsys.readouterr().out
    for f in dataclasses.fields(SlurmConfig):
        assert f"launcher.{f.name} = " in text and f.metadata["help"] in text


def test_a_sweep_worker_job_is_one_task_and_more_is_refused(capsys, tmp_path):
    """A sweep worker job runs one driver; its trials' ranks come from trainer.devices, started inside the job."""
    gpus = job_parameters(load_slurm_config(["launcher.gpus_per_node=8"]), "w", tasks=1)
    assert (gpus["ntasks_per_node"], gpus["gpus_per_node"]) == (1, 8)
    sweep = tmp_path / "s.yaml"
    sweep.write_text('{"study": "s", "metric": "rollout/return", "space": {"algo.q": {"type": "float", "low": 0, '
                     '"high": 1}}}')
    for key in ("launcher.tasks_per_node=2", "launcher.nodes=2"):
        assert main(["sweep", str(sweep), "--launcher", "slurm", key, "model=tiny"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"empo2 sweep: error: {key} is not allowed for a sweep") and "\n" not in err
