"""End-to-end training with the real Lightning Trainer, the tiny model and MiniSci."""

import json

import lightning as L
import numpy as np
import pytest
import torch

from empo2.config import load_config
from empo2.lit.data import collate
from empo2.rollout.types import StepSample
from empo2.workflows.train import train

FAST = ["model=tiny", "logger=none", "trainer.iterations=2", "trainer.mini_batch_size=4",
        "trainer.micro_batch_size=2", "trainer.lr=1e-3", "trainer.val_every=1", "trainer.ckpt_every=1",
        "rollout.tasks_per_batch=2", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "rollout.tip_max_new_tokens=12", "rollout.max_prompt_tokens=384", "env.max_steps=3",
        "env.val_variations=1", "algo.p=0.5", "algo.q=0.5", "seed=0"]


def _weights(path):
    sd = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in sd.items() if k.startswith("policy.")}


def test_two_iterations_update_the_policy_and_write_a_summary(tmp_path):
    from empo2.models import load_policy

    cfg = load_config(FAST + [f"run_root={tmp_path}", "run_name=r"])
    summary = train(cfg)
    initial, _ = load_policy(cfg.model)
    final = _weights(summary["checkpoint"])
    changed = [k for k, v in initial.state_dict().items() if not torch.equal(final[f"policy.{k}"], v)]
    assert changed, "no parameter changed after two iterations"
    saved = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert saved["config"]["algo"]["p"] == 0.5
    for key in ("rollout/return", "rollout/success", "rollout/episode_len", "val/score_nomem", "memory/size"):
        assert key in saved["metrics"], key
    rollouts = [h for h in saved["history"] if "rollout/return" in h]
    assert len(rollouts) == 2
    # the linear schedule spans the iterations that run: beta_start on the first, beta_end on the last
    assert [h["algo/beta"] for h in rollouts] == pytest.approx([cfg.algo.beta_start, cfg.algo.beta_end])
    n_traj = cfg.rollout.tasks_per_batch * cfg.rollout.group_size  # env steps = episode length x episodes
    assert [h["train/env_steps"] for h in rollouts] == pytest.approx(
        np.cumsum([h["rollout/episode_len"] * n_traj for h in rollouts]).tolist())
    assert (tmp_path / "r" / "learning_curve.png").is_file()


class StopAfter(L.Callback):
    """Ends a run after `n` iterations, as an interruption would (its config still says 4)."""

    def __init__(self, n):
        self.n = n

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch + 1 >= self.n:
            trainer.should_stop = True


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    four = FAST + ["trainer.iterations=4", f"run_root={tmp_path}"]
    straight = train(load_config(four + ["run_name=a"]))
    train(load_config(four + ["run_name=b"]), callbacks=[StopAfter(2)])
    resumed = train(load_config(four + ["run_name=b", "resume=auto"]))
    wa, wb = _weights(straight["checkpoint"]), _weights(resumed["checkpoint"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    def untimed(history):
        return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]

    assert untimed(straight["history"]) == untimed(resumed["history"])
    ma = torch.load(straight["checkpoint"], map_location="cpu", weights_only=True)["callbacks"]
    mb = torch.load(resumed["checkpoint"], map_location="cpu", weights_only=True)["callbacks"]
    ka, kb = next(k for k in ma if "Rollout" in k), next(k for k in mb if "Rollout" in k)
    assert ma[ka]["worker"]["memory"]["records"] == mb[kb]["worker"]["memory"]["records"]
    assert ma[ka]["worker"]["novelty"] == mb[kb]["worker"]["novelty"]
    # resuming a run that has finished collects nothing more: no rollout, no step, the same end state
    again = train(load_config(four + ["run_name=b", "resume=auto"]))
    assert untimed(again["history"]) == untimed(resumed["history"])
    assert again["metrics"]["train/env_steps"] == resumed["metrics"]["train/env_steps"]


def test_release_memory_trims_before_every_backward_and_changes_nothing_learned(tmp_path, monkeypatch):
    import empo2.lit.module as module_mod

    calls: list[int] = []
    real = module_mod.release_free_memory
    monkeypatch.setattr(module_mod, "release_free_memory", lambda: (calls.append(1), real())[1])
    backwards: list[int] = []
    real_backward = module_mod.EMPO2Module.manual_backward
    monkeypatch.setattr(module_mod.EMPO2Module, "manual_backward",
                        lambda self, *a, **k: (backwards.append(1), real_backward(self, *a, **k))[1])
    runs = {}
    for release in (False, True):
        calls.clear()
        backwards.clear()
        runs[release] = train(load_config(FAST + [f"run_root={tmp_path}", f"run_name=r{int(release)}",
                                                  f"trainer.release_memory={str(release).lower()}"]))
        assert len(calls) == (len(backwards) if release else 0) and backwards
    wa, wb = _weights(runs[False]["checkpoint"]), _weights(runs[True]["checkpoint"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_ddp_on_two_cpu_processes_keeps_ranks_identical(tmp_path):
    """Two gloo ranks collect different rollouts, all-reduce gradients and all-gather tips: they must end
    with identical weights and identical memories."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "empo2.cli", "train", "trainer=ddp", "trainer.accelerator=cpu", *FAST,
           f"run_root={tmp_path}", "run_name=ddp"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0 = json.loads((tmp_path / "ddp" / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "ddp" / "rank1.json").read_text())
    assert r0["weights_sha256"] == r1["weights_sha256"]
    assert r0["memory_records"] == r1["memory_records"] and len(r0["memory_records"]) > 0
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["config"]["trainer"]["strategy"] == "ddp"


class ReferenceProbe(L.Callback):
    """Scores one fixed response under the policy and under the module's KL reference, before the first update
    and after the last: `before` is the initial policy, which the reference must go on scoring exactly."""

    def __init__(self):
        sample = StepSample(behaviour_ids=[5, 9, 14, 3, 7], train_ids=[5, 9, 14, 3, 7], response_ids=[11, 4, 2],
                            memory=False, offpolicy=False, group_id=0, traj_id=0, step=0)
        self.sample, self.scores = sample, {}

    @torch.no_grad()
    def _score(self, module, when):
        batch = collate([self.sample], module.pad_id)
        was_training = module.policy.training
        module.policy.eval()  # LoRA dropout off: the same weights score the same
        self.scores[f"policy_{when}"] = module.response_logprobs(batch)
        self.scores[f"ref_{when}"] = module.ref_logprobs(batch)
        module.policy.train(was_training)

    def on_fit_start(self, trainer, pl_module):
        self._score(pl_module, "before")

    def on_train_end(self, trainer, pl_module):
        self._score(pl_module, "after")


def kl_reference_problems(tmp_path, lora: int) -> list[str]:
    """Trains one iteration with a KL penalty and lists what is wrong with its reference: it must score as the
    initial policy after the policy has moved, and the logged KL to it must then be positive."""
    import mlflow

    probe = ReferenceProbe()
    cfg = load_config(FAST + ["trainer.iterations=1", "algo.kl_coef=0.1", f"model.lora_r={lora}",
                              f"run_root={tmp_path}", "run_name=kl", "logger=mlflow"])
    summary = train(cfg, callbacks=[probe])
    s = probe.scores
    assert not torch.allclose(s["policy_after"], s["policy_before"], atol=1e-4), "the policy did not move"
    problems = []
    if not torch.equal(s["ref_before"], s["policy_before"]):
        problems.append("the reference does not start as the policy")
    if not torch.allclose(s["ref_after"], s["policy_before"], rtol=0, atol=1e-6):
        problems.append("the reference moved with the policy")
    kl = mlflow.MlflowClient(summary["mlflow_tracking_uri"]).get_run(summary["mlflow_run_id"]).data.metrics
    if not kl.get("actor/kl_ref", 0.0) > 0.0:  # k3 is > 0 wherever the policy differs from the reference
        problems.append(f"actor/kl_ref is {kl.get('actor/kl_ref')}, not > 0, after the policy moved")
    return problems


@pytest.mark.parametrize("lora", [0, 4])
def test_kl_to_a_frozen_reference_is_logged_and_the_reference_stays_frozen(tmp_path, lora):
    """Full weights: a frozen copy; LoRA: the same model with its adapters off."""
    assert kl_reference_problems(tmp_path, lora) == []


def test_a_reference_that_scores_the_live_policy_is_caught(tmp_path, monkeypatch):
    """The mutant the check above exists for: a reference that is the live policy (KL always 0)."""
    from empo2.lit.module import EMPO2Module

    monkeypatch.setattr(EMPO2Module, "ref_logprobs", torch.no_grad()(EMPO2Module.response_logprobs))
    assert set(kl_reference_problems(tmp_path, 0)) == {
        "the reference moved with the policy", "actor/kl_ref is 0.0, not > 0, after the policy moved"}


def test_resume_from_an_explicit_checkpoint_path(tmp_path):
    first = train(load_config(FAST + [f"run_root={tmp_path}", "run_name=a", "trainer.iterations=1"]))
    again = train(load_config(FAST + [f"run_root={tmp_path}", "run_name=b", f"resume={first['checkpoint']}"]))
    assert [h["iteration"] for h in again["history"] if "rollout/return" in h] == [0, 1]
    with pytest.raises(Exception, match="resume='/nope.ckpt' is not allowed"):
        load_config(FAST + ["resume=/nope.ckpt"])


def test_validation_before_training_logs_the_baseline_at_iteration_minus_one(tmp_path):
    import mlflow

    cfg = load_config(FAST + [f"run_root={tmp_path}", "run_name=v", "logger=mlflow", "trainer.iterations=1",
                              "trainer.val_before_train=true"])
    summary = train(cfg)
    first = summary["history"][0]
    assert first["iteration"] == -1 and first["train/env_steps"] == 0.0 and "val/score_nomem" in first
    assert "rollout/return" not in first  # no rollout happened before it
    client = mlflow.MlflowClient(summary["mlflow_tracking_uri"])
    steps = [(m.step, m.value) for m in client.get_metric_history(summary["mlflow_run_id"], "train/env_steps")]
    assert steps[0] == (-1, 0.0) and steps[1][0] == 0 and steps[1][1] > 0
    assert [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "val/score_nomem")] == [-1, 0]
    # one x-axis: the update's metrics are one value per iteration, at the iteration; no progress-bar copies
    logged = client.get_run(summary["mlflow_run_id"]).data.metrics
    assert not {"return", "success", "mem", "epoch"} & set(logged)
    for key in ("actor/loss", "actor/grad_norm", "train/lr"):
        assert [m.step for m in client.get_metric_history(summary["mlflow_run_id"], key)] == [0], key
    resumed = train(load_config(FAST + [f"run_root={tmp_path}", "run_name=v", "logger=mlflow",
                                        "trainer.iterations=2", "trainer.val_before_train=true", "resume=auto"]))
    assert [h["iteration"] for h in resumed["history"] if "val/score_nomem" in h] == [-1, 0, 1]  # baseline once


def test_a_plain_train_run_uploads_its_config_and_files_to_mlflow(tmp_path):
    import subprocess
    import sys

    import mlflow

    cmd = [sys.executable, "-m", "empo2.cli", "train", *FAST, "trainer.iterations=1", "logger=mlflow",
           f"run_root={tmp_path}", "run_name=p"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "p" / "summary.json").read_text())
    client = mlflow.MlflowClient(summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["algo.p"] == "0.5" and run.data.params["model.name"] == "tiny"
    tags = run.data.tags
    assert (tags["algo"], tags["env"], tags["model"], tags["seed"]) == ("empo2", "minisci", "tiny", "0")
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    if head:  # a git checkout: the commit that ran
        assert tags["git_commit"].removesuffix("-dirty") == head
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"learning_curve.png", "summary.json",
                                                                        "config.yaml"}
    import yaml

    assert yaml.safe_load((tmp_path / "p" / "config.yaml").read_text()) == summary["config"]


def test_validation_on_the_training_instances_scores_the_variations_the_run_trains_on(tmp_path):
    from empo2.envs import get_catalogue
    from empo2.rollout.build import validation_tasks

    args = FAST + [f"run_root={tmp_path}", "run_name=t", "trainer.iterations=1", "trainer.val_train=true",
                   "env.train_variations=2", "env.val_variations=3", "env.tasks=[find-living-thing]"]
    cfg = load_config(args)
    held_out, seen = validation_tasks(cfg), validation_tasks(cfg, on_train=True)
    cat = get_catalogue("minisci")
    assert [t.variation for t in seen] == cat.split("find-living-thing", "train")[:2]  # within train_variations
    assert [t.variation for t in held_out] == cat.split("find-living-thing", "test")[:3]
    [h] = [h for h in train(cfg)["history"] if "val/score_nomem" in h]
    assert {"val_train/score_nomem", "val_train/success_nomem", "val_train/episode_len_nomem"} <= set(h)
    assert 0.0 <= h["val_train/score_nomem"] <= 100.0
    # each instance's own score beside the mean (intervals that resample instances within a seed read them)
    for prefix, tasks in (("val", held_out), ("val_train", seen)):
        per_instance = {k: v for k, v in h.items() if k.startswith(f"{prefix}/score_nomem/")}
        assert sorted(per_instance) == sorted(f"{prefix}/score_nomem/{t.task}-{t.variation}" for t in tasks)
        assert np.mean(list(per_instance.values())) == pytest.approx(h[f"{prefix}/score_nomem"])


def test_resume_auto_without_a_run_name_resumes_the_newest_unfinished_run_or_refuses(tmp_path):
    from empo2.config import ConfigError

    args = FAST + [f"run_root={tmp_path}", "trainer.iterations=2"]
    with pytest.raises(ConfigError, match=r"^resume=auto without run_name: no unfinished run under "):
        train(load_config(args + ["resume=auto"]))
    assert not any(tmp_path.iterdir())  # refused before anything was made
    train(load_config(args + ["run_name=done"]))  # finished: has its summary.json
    train(load_config(args + ["run_name=cut"]), callbacks=[StopAfter(1)])
    (tmp_path / "cut" / "summary.json").unlink()  # as a run killed after its first checkpoint leaves it
    resumed = train(load_config(args + ["resume=auto"]))
    assert resumed["run_dir"] == str(tmp_path / "cut")
    assert [h["iteration"] for h in resumed["history"] if "rollout/return" in h] == [0, 1]


def test_two_trainings_in_one_process_without_run_names_get_their_own_folders(tmp_path):
    args = FAST + [f"run_root={tmp_path}", "trainer.iterations=1"]
    first, second = train(load_config(args)), train(load_config(args))
    assert first["run_dir"] != second["run_dir"]
    assert "EMPO2_RUN_NAME" not in __import__("os").environ


def test_empo2_train_pauses_the_collector_for_its_start_up_and_thaws_what_it_froze(tmp_path, monkeypatch):
    """`empo2 train`: Python's cyclic collector is off from the command's start to the first rollout, then on with
    the start-up's objects frozen, and on with nothing frozen once the command returns, also when its start-up
    fails."""
    import gc

    import empo2.lit.callbacks
    from empo2 import utils
    from empo2.cli import main

    seen = []

    def settle():
        seen.append(gc.isenabled())
        utils.settle_startup_heap()
        seen.append((gc.isenabled(), gc.get_freeze_count()))

    monkeypatch.setattr(empo2.lit.callbacks, "settle_startup_heap", settle)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert main(["train", *FAST, f"run_root={tmp_path}", "trainer.iterations=1"]) == 0
    assert seen[0] is False
    assert seen[1][0] is True and seen[1][1] > 100_000  # torch, Lightning, the model ...
    assert gc.isenabled() and gc.get_freeze_count() == 0
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path / "empty"))  # no prior built: the model cannot load
    assert main(["train", *FAST, f"run_root={tmp_path}", "model.name=minisci_bc"]) == 2
    assert len(seen) == 2 and gc.isenabled() and gc.get_freeze_count() == 0


def test_processes_started_by_torchrun_or_srun_need_a_run_name(monkeypatch):
    """Without run_name each process torchrun or srun starts would name its own run folder after its own clock."""
    from empo2.config import ConfigError
    from empo2.workflows.train import resume_run_name

    for var in ("WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NAME", "EMPO2_RUN_NAME"):
        monkeypatch.delenv(var, raising=False)
    for started in ({"WORLD_SIZE": "2"}, {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "grid/run"}):
        with monkeypatch.context() as m:
            for var, value in started.items():
                m.setenv(var, value)
            with pytest.raises(ConfigError, match="run_name is required when torchrun or srun starts the processes"):
                resume_run_name(load_config(FAST))
            assert resume_run_name(load_config(FAST + ["run_name=r"])) == "r"
    # an interactive allocation: Lightning ignores its tasks and starts the ranks itself; so does a one-task job
    for ntasks, job in (("2", "interactive"), ("1", "grid/run")):
        with monkeypatch.context() as m:
            m.setenv("SLURM_NTASKS", ntasks)
            m.setenv("SLURM_JOB_NAME", job)
            assert resume_run_name(load_config(FAST + ["resume=never"])) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("EMPO2_RUN_NAME", "spawned")  # Lightning's own DDP launcher hands its children the name
    assert resume_run_name(load_config(FAST)) == "spawned"


def test_memory_only_sets_later_visits_against_the_tip_free_first_visit_and_resumes_it(tmp_path):
    """p = 1: no group holds a tip-free rollout, so `rollout/memory_gain` is never logged; the estimate that fits is
    `rollout/first_visit_gain`, over the run so far. One training instance: iteration 0 is its first visit (an
    empty memory, every rollout finds nothing), every later one reads its tips (min_sim -1)."""
    three = [o for o in FAST if not o.startswith("algo.")] + [
        "experiment=memory_only_minisci", "trainer.iterations=3", "env.tasks=[find-living-thing]",
        "env.train_variations=1", "memory.min_sim=-1", f"run_root={tmp_path}"]
    straight = train(load_config(three + ["run_name=a"]))
    rollouts = [h for h in straight["history"] if "rollout/return" in h]
    n_traj = 2 * 4  # tasks_per_batch x group_size
    assert [h["rollout/episodes_mem_miss"] for h in rollouts] == [n_traj, 0, 0]
    assert all(h["rollout/memory_gain_groups"] == 0 and "rollout/memory_gain" not in h for h in rollouts)
    assert rollouts[0]["rollout/first_visit_gain_instances"] == 0 and "rollout/first_visit_gain" not in rollouts[0]
    first = rollouts[0]["rollout/score_mem_miss"]
    for i in (1, 2):  # later visits, pooled over the iterations so far, minus the first visit
        later = rollouts[1:i + 1]
        mean_later = sum(h["rollout/score_mem"] * h["rollout/episodes_mem"] for h in later) / \
            sum(h["rollout/episodes_mem"] for h in later)
        assert rollouts[i]["rollout/first_visit_gain_instances"] == 1
        assert rollouts[i]["rollout/first_visit_gain"] == pytest.approx(mean_later - first)
    # a resumed run carries the visits over: its estimate is the uninterrupted run's
    train(load_config(three + ["run_name=b"]), callbacks=[StopAfter(2)])
    resumed = train(load_config(three + ["run_name=b", "resume=auto"]))
    assert resumed["metrics"]["rollout/first_visit_gain"] == straight["metrics"]["rollout/first_visit_gain"]
