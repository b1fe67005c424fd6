"""`trainer=fsdp` (FSDP2, `fully_shard`) on two CPU processes with gloo: the gathering around calls made outside a
training step, agreement with DDP, the one-file checkpoint, resumes on two processes and on one, and `empo2 eval`.

Tolerance: FSDP scores each micro-batch in one padded pass where DDP on a CPU runs length buckets, reduces
gradients by reduce-scatter where DDP all-reduces, and sums the gradient norm over shards; all of it is float32
rounding, which Adam amplifies where a gradient is near zero. After 2 iterations (12 optimiser steps at lr 1e-3,
which move a weight by up to 1.2e-2) the tiny model's weights differ from DDP's by at most 1.3e-5, 2.7e-5 when
the old log-probs come from the scoring pass, which FSDP runs on the shards. ATOL is 0.4% of the weights' travel:
a wrong weighting of ranks shows far above it, and tests/integration/test_data_parallel.py checks the weighting
itself on gradients, before any optimiser step.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.test_training import FAST
from tests.services import spawn_ranks, train_in_ranks

FSDP = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.precision=32-true"]
# one torch thread per process: two processes share the two cores, and reruns must do identical float math
RUN = FAST + ["torch_threads=1"]
ATOL = 5e-5


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("EMPO2_FAULT", "EMPO2_RUN_NAME")}
    proc = subprocess.run([sys.executable, "-m", "empo2.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _train(root: Path, name: str, *overrides: str) -> Path:
    train_in_ranks([*RUN, *overrides, f"run_root={root}", f"run_name={name}"])
    return root / name


def _checkpoint(run: Path, name: str = "last.ckpt") -> dict:
    return torch.load(run / "checkpoints" / name, map_location="cpu", weights_only=True)


def _history(run: Path) -> list[dict]:
    history = json.loads((run / "summary.json").read_text())["history"]
    return [{k: v for k, v in h.items() if not k.startswith("time/")} for h in history]


def _optimizer(ckpt: dict) -> dict:
    return ckpt["optimizer_states"][0]["state"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _resume_from(ckpt: Path) -> str:
    return f"resume='{ckpt}'"  # quoted: the file name holds '='


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """Two iterations of `trainer=fsdp` on two gloo processes, a checkpoint after each."""
    return _train(tmp_path_factory.mktemp("fsdp"), "fsdp", *FSDP, "trainer.devices=2")


# ---------------------------------------------------------------------------------------- gathering
def _unsharded_worker(rank: int, port: int, results) -> None:
    """One of two gloo ranks: uneven numbers of forwards inside `unsharded`, then a training step."""
    import copy
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from empo2.config import ModelConfig
    from empo2.lit.strategy import shard_policy, unsharded
    from empo2.models import load_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))  # a hang fails
    try:
        torch.manual_seed(0)  # the adapters' init must agree across ranks
        policy, _ = load_policy(ModelConfig(name="tiny", lora_r=4))
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.data.normal_()  # zero at init: no gradient would reach lora_A
        reference = copy.deepcopy(policy)
        shard_policy(policy, init_device_mesh("cpu", (2,)), MixedPrecisionPolicy())
        units = sum(isinstance(m, FSDPModule) for m in policy.modules())
        gathers = []  # FSDP2's all-gathers, counted where it issues them
        real = dist.all_gather_single
        dist.all_gather_single = lambda *a, **k: (gathers.append(1), real(*a, **k))[1]
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with unsharded(policy):
            on_entry = len(gathers)
            with torch.no_grad():
                if rank == 1:  # the decoder alone first, as the HF engine's prefill calls it
                    policy.get_base_model().model(input_ids=ids)
                    policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                    do_sample=False, synced_gpus=False)  # as HFEngine generates
                for _ in range(1 + 3 * rank):
                    policy(input_ids=ids)
            inside = len(gathers) - on_entry
        resharded = all(isinstance(p, DTensor) for p in policy.parameters())
        before = len(gathers)
        policy(input_ids=ids, labels=ids).loss.backward()
        reference(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in policy.named_parameters() if p.requires_grad}
        expected = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
        same = grads.keys() == expected.keys() and all(torch.allclose(grads[n], expected[n], atol=1e-6)
                                                       for n in grads)
        results.put((rank, on_entry == units, inside, resharded, len(gathers) > before, same))
    finally:
        dist.destroy_process_group()


def test_unsharded_gathers_each_unit_once_so_ranks_may_run_different_numbers_of_forwards():
    """Inside `unsharded` a forward issues no collective (rank 0 runs one forward, rank 1 a decoder call, a
    generate and four forwards, and neither hangs); on exit the weights are shards again and the next training
    step gathers them and gives the unsharded model's gradient."""
    assert spawn_ranks(_unsharded_worker) == [(0, True, 0, True, True, True), (1, True, 0, True, True, True)]


def _score_worker(rank: int, port: int, results) -> None:
    """One of two gloo ranks: old log-probs on the sharded policy, with uneven numbers of micro-batches (5 and 1
    samples, then 3 and none), against the same pass on an unsharded copy; the KL reference sharded alike."""
    import copy
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from empo2.config import AlgoConfig, ModelConfig, TrainerConfig
    from empo2.lit.data import RolloutBuffer, collate
    from empo2.lit.module import EMPO2Module
    from empo2.lit.strategy import shard_policy
    from empo2.models import load_policy
    from empo2.rollout.types import StepSample

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))  # a hang fails
    try:
        torch.manual_seed(0)  # the same weights on both ranks
        policy, tok = load_policy(ModelConfig(name="tiny"))
        policy.eval()
        reference = EMPO2Module(copy.deepcopy(policy), tok, AlgoConfig(), TrainerConfig(), RolloutBuffer(),
                                temperature=0.7)
        ref_policy = copy.deepcopy(policy)
        mesh = init_device_mesh("cpu", (2,))
        shard_policy(policy, mesh, MixedPrecisionPolicy())
        shard_policy(ref_policy, mesh, MixedPrecisionPolicy(), frozen=True)
        module = EMPO2Module(policy, tok, AlgoConfig(kl_coef=0.1), TrainerConfig(), RolloutBuffer(),
                             ref_policy=ref_policy, temperature=0.7)
        g = torch.Generator().manual_seed(rank)

        def samples(n: int) -> list[StepSample]:
            out = []
            for i in range(n):
                prompt = torch.randint(3, 200, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
                response = torch.randint(3, 200, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
                out.append(StepSample(behaviour_ids=prompt, train_ids=prompt, response_ids=response, memory=False,
                                      offpolicy=False, group_id=0, traj_id=i, step=0))
            return out

        gaps, counts = [], []
        for n in ((5, 3), (1, 0))[rank]:  # micro-batches of 2: 3 forwards against 1, then 2 against none
            batch = samples(n)
            got, expected = module.score_behaviour(batch, 2), reference.score_behaviour(batch, 2)
            counts.append(len(got))
            gaps += [float((a - b).abs().max()) for a, b in zip(got, expected)]
        resharded = all(isinstance(p, DTensor) for p in policy.parameters())
        # the reference, sharded: the same log-probs as the policy's own (identical weights), no unit left gathered
        batch = collate(samples(2), tok.pad_token_id)
        valid = batch["response_mask"].bool()  # past a row's response the padded pass and the packed one differ
        with torch.no_grad():
            ref_gap = float((module.ref_logprobs(batch) - reference.response_logprobs(batch))[valid].abs().max())
        ref_sharded = all(isinstance(p, DTensor) for p in ref_policy.parameters())
        results.put((rank, counts, max(gaps, default=0.0) < 1e-5, resharded, ref_gap < 1e-5, ref_sharded))
    finally:
        dist.destroy_process_group()


def test_old_logprobs_run_on_the_shards_with_forwards_padded_to_the_busiest_rank():
    """Ranks holding different numbers of samples (3 forwards against 1, then 2 against none) score them on the
    sharded policy without hanging, equal to an unsharded copy's scores to float32 rounding, and leave every unit
    sharded; the KL reference, sharded too, scores as the unsharded model does."""
    assert spawn_ranks(_score_worker) == [(0, [5, 3], True, True, True, True), (1, [1, 0], True, True, True, True)]


# ------------------------------------------------------------------------------------ against DDP
@pytest.mark.slow
# scored: the old log-probs come from the trainer's scoring pass (on the shards under FSDP, forwards padded to the
# busiest rank's) instead of from generate, and the update that follows it must still reach every layer
@pytest.mark.parametrize("extra", [[], ["model.lora_r=4", "trainer.gradient_checkpointing=true"],
                                   ["rollout.generation_logprobs=false"]],
                         ids=["full", "lora_checkpointing", "scored"])
def test_fsdp_on_two_cpu_processes_matches_ddp_and_writes_one_full_checkpoint(tmp_path, fsdp_run, extra):
    """The same config and seed under ddp and fsdp: the same rollouts and validations, weights and optimizer state
    within ATOL after 12 optimiser steps; ranks agree; the checkpoint is one file of full tensors laid out as DDP's."""
    ddp = _train(tmp_path, "ddp", "trainer=ddp", "trainer.accelerator=cpu", *extra)
    fsdp = _train(tmp_path, "fsdp", *FSDP, "trainer.devices=2", *extra) if extra else fsdp_run
    a, b = _checkpoint(ddp), _checkpoint(fsdp)
    assert (fsdp / "checkpoints" / "last.ckpt").is_file()  # one file, not a sharded checkpoint folder
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(type(v) is torch.Tensor and v.shape == a["state_dict"][k].shape for k, v in b["state_dict"].items())
    assert _max_diff(a["state_dict"], b["state_dict"]) < ATOL
    oa, ob = _optimizer(a), _optimizer(b)
    assert oa.keys() == ob.keys()  # keyed by the optimizer's parameter order, as torch.optim keys it
    assert all(torch.equal(oa[p]["step"], ob[p]["step"]) for p in oa)
    assert max(_max_diff({k: oa[p][k] for k in ("exp_avg", "exp_avg_sq")},
                         {k: ob[p][k] for k in ("exp_avg", "exp_avg_sq")}) for p in oa) < ATOL
    assert a["global_step"] == b["global_step"] > 0
    gap = "rollout/logprob_gap_"  # logged where the scoring pass runs: float32 rounding of differently shaped passes
    (ha, ga), (hb, gb) = ([[{k: v for k, v in h.items() if k.startswith(gap) == keep} for h in _history(run)]
                           for keep in (False, True)] for run in (ddp, fsdp))
    assert ha == hb
    assert all(x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-5 for k in x) for x, y in zip(ga, gb))
    ranks = [json.loads((fsdp / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["memory_records"]
    assert json.loads((fsdp / "summary.json").read_text())["config"]["trainer"]["strategy"] == "fsdp"


# --------------------------------------------------------------------------------------- resume
@pytest.mark.slow
def test_fsdp_checkpoint_resumes_exactly_on_two_processes_and_on_one(tmp_path, fsdp_run):
    """From the 2-process run's first checkpoint: on 2 processes, the uninterrupted run's end state bit for bit;
    on 1 process (the data then differ from the 2-process run's), the same continuation as a plain single-process
    resume of the same file: its first rollout played from exactly the restored weights, memory and counters."""
    first = fsdp_run / "checkpoints" / "iter-epoch=0000.ckpt"
    two = _train(tmp_path, "two", *FSDP, "trainer.devices=2", _resume_from(first))
    a, b = _checkpoint(fsdp_run), _checkpoint(two)
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    oa, ob = _optimizer(a), _optimizer(b)
    assert all(torch.equal(oa[p][k], ob[p][k]) for p in oa for k in ("exp_avg", "exp_avg_sq", "step"))
    assert a["global_step"] == b["global_step"] and _history(fsdp_run) == _history(two)

    one = _train(tmp_path, "one", *FSDP, "trainer.devices=1", _resume_from(first))
    # with the update of the fsdp preset (not the one-process laptop-memory defaults), so the two run the same passes
    plain = _train(tmp_path, "plain", "trainer=cpu", "trainer.gradient_checkpointing=false",
                   "trainer.micro_batch_tokens=null", "trainer.release_memory=false", _resume_from(first))
    assert _history(one)[:3] == _history(plain)[:3]  # iteration 0 (restored), its validation, iteration 1's rollouts
    c, d = _checkpoint(one), _checkpoint(plain)
    assert c["global_step"] == d["global_step"] > a["global_step"] // 2
    assert _max_diff(c["state_dict"], d["state_dict"]) < ATOL


@pytest.mark.slow
def test_empo2_eval_scores_the_fsdp_checkpoint(tmp_path, fsdp_run):
    """`empo2 eval` loads the policy from the FSDP run's checkpoint (strictly: every name and shape) and plays."""
    out = tmp_path / "eval"
    proc = _cli("eval", f"ckpt={fsdp_run}", "memory=off", "variations=1", f"out={out}")
    report = json.loads(Path(proc.stdout.split("results: ")[-1].strip()).read_text())
    assert report["checkpoint"] == str(fsdp_run / "checkpoints" / "last.ckpt")
    assert report["modes"]["nomem"]["episodes"] > 0
