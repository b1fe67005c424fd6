"""Float32 master weights: whatever dtype the weights are read in (`model.dtype`), the parameters that train and
AdamW's state are float32 after a step and after resuming a checkpoint written with bfloat16 weights and state, on
one process and under `trainer=fsdp` on two gloo processes (where they are DTensor shards); a LoRA base keeps the
load dtype, LoRA adapters are float32 and the KL reference computes in float32 like the policy; `empo2 eval`
plays in the load dtype; bfloat16 compute on float32 masters gives a float32 run's gradient to bfloat16
tolerance; the bfloat16 configuration at lr 1e-6 moves nearly every weight in one step (with bfloat16
weights, 2.3% moved); and under FSDP2 each shard is upcast after sharding."""

import copy
import functools
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor

from empo2.config import ModelConfig, load_config
from empo2.lit.data import RolloutBuffer, plan_epoch
from empo2.lit.module import EMPO2Module
from empo2.lit.strategy import float32_master_weights
from empo2.models import load_policy
from empo2.workflows.train import train
from tests.services import as_torchrun_rank, free_port, spawn_ranks

from .test_update_fidelity import _samples

# the issue's reproduction: the Qwen presets' bfloat16 load with the paper's learning rate, on the tiny model
REPRO = ["model=tiny", "model.dtype=bfloat16", "trainer.precision=bf16-mixed", "trainer.lr=1e-6",
         "trainer.iterations=1", "rollout.tasks_per_batch=1", "rollout.group_size=4", "env.max_steps=3",
         "env.val_variations=1", "logger=none"]
F32, BF16 = "torch.float32", "torch.bfloat16"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def dtype_report(module, optimizer) -> dict:
    """The dtypes (of DTensor shards: their local tensors) of the policy's trainable and frozen parameters, of
    AdamW's exp_avg/exp_avg_sq, and of the KL reference copy, as sorted strings; `sharded`: every trainable
    parameter and state tensor is a DTensor; `states`: how many parameters have AdamW state."""
    trainable = [p for p in module.policy.parameters() if p.requires_grad]
    state = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in s]

    def names(tensors):
        return sorted({str(_local(t).dtype) for t in tensors})

    frozen = [p for p in module.policy.parameters() if not p.requires_grad]
    ref = module.ref_policy
    return {"trainable": names(trainable), "frozen": names(frozen), "state": names(state),
            "states": len(optimizer.state),
            "ref": names(ref.parameters()) if ref is not None else [],
            # the reference's parameters are the policy's, dtype and value (so the KL is exactly 0 before a step)
            "ref_is_policy": ref is not None and all(
                r.dtype == p.dtype and torch.equal(_local(r), _local(p))
                for r, p in zip(ref.parameters(), module.policy.parameters(), strict=True)),
            "sharded": all(isinstance(t, DTensor) for t in trainable + state)}


class DtypeProbe(L.Callback):
    """`dtype_report` when the fit starts (after any restore) and after the first optimiser step; `restored`: the
    first trainable parameter and its exp_avg at the start, as full float tensors (rank 0 under FSDP)."""

    def __init__(self):
        self.seen: dict[str, dict] = {}
        self.restored: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        optimizer = trainer.optimizers[0]
        self.seen["start"] = dtype_report(pl_module, optimizer)
        name, p = next((n, p) for n, p in pl_module.policy.named_parameters() if p.requires_grad)
        full = p.full_tensor() if isinstance(p, DTensor) else p
        self.restored = {"name": name, "weight": full.detach().float().clone()}
        if p in optimizer.state:
            avg = optimizer.state[p]["exp_avg"]
            self.restored["exp_avg"] = (avg.full_tensor() if isinstance(avg, DTensor) else avg).float().clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if "step" not in self.seen and pl_module.last_step:  # set by the first optimiser step
            self.seen["step"] = dtype_report(pl_module, trainer.optimizers[0])


def old_style_checkpoint(src: Path, dst: Path) -> Path:
    """A checkpoint as runs wrote it before float32 master weights: the policy's weights and AdamW's exp_avg and
    exp_avg_sq in bfloat16 (the rest, `step` included, as it was)."""
    ckpt = torch.load(src, map_location="cpu", weights_only=True)
    ckpt["state_dict"] = {k: v.bfloat16() if v.is_floating_point() else v for k, v in ckpt["state_dict"].items()}
    for opt in ckpt["optimizer_states"]:
        for s in opt["state"].values():
            s["exp_avg"], s["exp_avg_sq"] = s["exp_avg"].bfloat16(), s["exp_avg_sq"].bfloat16()
    torch.save(ckpt, dst)
    return dst


# ------------------------------------------------------------------------------------------ one process
@pytest.fixture(scope="module")
def repro(tmp_path_factory):
    """The reproduction run with a `DtypeProbe`: (summary, probe)."""
    probe = DtypeProbe()
    root = tmp_path_factory.mktemp("repro")
    summary = train(load_config(REPRO + [f"run_root={root}", "run_name=repro"]), callbacks=[probe])
    return summary, probe


def test_the_bfloat16_configuration_at_lr_1e_6_moves_nearly_every_weight_in_one_step(repro):
    """Read in bfloat16, trained as float32 master weights: a step of AdamW (about lr x sign of the gradient at the
    first step) moves >= 99% of the trainable weights, where bfloat16 weights rounded all but 2.3% of the moves away;
    weights and state are float32 after it, in the checkpoint too."""
    summary, probe = repro
    initial, _ = load_policy(load_config(REPRO).model)
    final = torch.load(summary["checkpoint"], map_location="cpu", weights_only=True)
    weights = final["state_dict"]
    params = dict(initial.named_parameters())  # a tied weight once
    assert {str(p.dtype) for p in params.values()} == {BF16}
    changed = sum(int((weights[f"policy.{n}"] != p.float()).sum()) for n, p in params.items())
    total = sum(p.numel() for p in params.values())
    assert changed >= 0.99 * total, f"{changed} of {total} weights changed"
    assert probe.seen["start"]["trainable"] == probe.seen["step"]["trainable"] == [F32]
    assert probe.seen["step"]["state"] == [F32] and probe.seen["step"]["states"] == len(params)
    assert {str(v.dtype) for k, v in weights.items() if k.startswith("policy.")} == {F32}
    assert {str(s[k].dtype) for s in final["optimizer_states"][0]["state"].values()
            for k in ("exp_avg", "exp_avg_sq")} == {F32}


def test_a_checkpoint_with_bfloat16_weights_and_state_resumes_into_float32(repro, tmp_path):
    """The checkpoint of a run from before float32 master weights (bfloat16 weights and AdamW state): its values are
    restored, exactly, into float32 weights and float32 state, which stay float32 through the next step."""
    summary, _ = repro
    old = old_style_checkpoint(Path(summary["checkpoint"]), tmp_path / "old.ckpt")
    saved = torch.load(old, map_location="cpu", weights_only=True)
    probe = DtypeProbe()
    train(load_config(REPRO + ["trainer.iterations=2", f"run_root={tmp_path}", "run_name=resumed",
                               f"resume={old}"]), callbacks=[probe])
    assert probe.seen["start"]["trainable"] == probe.seen["start"]["state"] == [F32]
    assert probe.seen["step"]["trainable"] == probe.seen["step"]["state"] == [F32]
    r = probe.restored
    assert torch.equal(r["weight"], saved["state_dict"][f"policy.{r['name']}"].float())
    assert torch.equal(r["exp_avg"], saved["optimizer_states"][0]["state"][0]["exp_avg"].float())


@pytest.mark.parametrize("extra", [["algo.kl_coef=0.1"], ["model.lora_r=4"]], ids=["kl_reference", "lora"])
def test_a_lora_base_keeps_the_load_dtype_and_the_kl_reference_computes_like_the_policy(tmp_path, extra):
    """A LoRA base stays bfloat16 (read in, never trained); the trainable parameters (all of them; the LoRA adapters,
    which peft makes float32 itself) and their state are float32; the KL reference copy is float32 like the policy
    and, before the first step, equal to it (a bfloat16 reference computes differently: the KL would not start
    at 0)."""
    probe = DtypeProbe()
    train(load_config(REPRO + extra + [f"run_root={tmp_path}", "run_name=r"]), callbacks=[probe])
    step = probe.seen["step"]
    assert step["trainable"] == step["state"] == [F32]
    if "algo.kl_coef=0.1" in extra:
        assert step["ref"] == [F32] and step["frozen"] == [] and probe.seen["start"]["ref_is_policy"]
    else:
        assert step["ref"] == [] and step["frozen"] == [BF16]


def eval_policy(ckpt: Path, out: Path, monkeypatch) -> tuple[list[str], bool]:
    """`empo2 eval` of a checkpoint (memory off, one variation): the dtypes of the policy it plays with, and whether
    its weights are the checkpoint's rounded to bfloat16."""
    import empo2.rollout.build as build
    from empo2.workflows.evaluate import evaluate, run_config

    seen = {}
    real = build.build_worker

    def spy(cfg, model, *args, **kwargs):
        seen["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        seen["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
        return real(cfg, model, *args, **kwargs)

    monkeypatch.setattr(build, "build_worker", spy)
    evaluate(run_config(ckpt, []), ckpt, memory="off", variations=1, out=out)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return seen["dtypes"], all(torch.equal(v, saved[f"policy.{k}"].bfloat16()) for k, v in seen["weights"].items())


def test_empo2_eval_plays_in_the_load_dtype(repro, tmp_path, monkeypatch):
    """`empo2 eval` reads the run's policy in `model.dtype` (bfloat16 here), the checkpoint's float32 master weights
    rounded to it."""
    assert eval_policy(Path(repro[0]["checkpoint"]), tmp_path, monkeypatch) == ([BF16], True)


def test_fsdp_upcasts_each_shard_after_sharding(monkeypatch):
    """`configure_model` under FSDP2 (one gloo process, its own group): when `float32_master_weights` runs, every
    trainable parameter is already a DTensor shard, still in the load dtype (bfloat16), so no rank ever holds the
    whole model in float32; after it, the shards are float32 DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import empo2.lit.module as lit_module
    from empo2.lit.strategy import FSDP2Strategy

    seen = {}

    def spy(policy, frozen=False):
        trainable = [p for p in policy.parameters() if p.requires_grad]
        seen["before"] = ({type(p).__name__ for p in trainable}, {str(p.dtype) for p in trainable})
        float32_master_weights(policy, frozen)

    monkeypatch.setattr(lit_module, "float32_master_weights", spy)
    cfg = load_config(REPRO + ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=1"])
    policy, tok = load_policy(cfg.model)
    module = EMPO2Module(policy, tok, cfg.algo, cfg.trainer, RolloutBuffer([]))
    # a vLLM engine built in this process before (another test file on the same pytest worker) leaves vLLM's own
    # one-process group as the default group: FSDP2 runs on that one, and only a group made here is destroyed here
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        strategy = FSDP2Strategy(mixed_precision=True)
        strategy.parallel_devices = [torch.device("cpu")]
        strategy._device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("data_parallel",))
        module.trainer = type("Trainer", (), {"strategy": strategy})()
        module.configure_model()
    finally:
        if ours:
            dist.destroy_process_group()
    assert seen["before"] == ({"DTensor"}, {BF16})
    trainable = [p for p in module.policy.parameters() if p.requires_grad]
    assert {type(p).__name__ for p in trainable} == {"DTensor"}
    assert {str(p.dtype) for p in trainable} == {str(p.to_local().dtype) for p in trainable} == {F32}


# --------------------------------------------------------------------------------------- the gradient
def _gradient(policy, tok, samples, autocast: bool) -> dict[str, torch.Tensor]:
    """The pre-clip gradient of one mini-batch of `samples` (old log-probs from the same weights, so ratios are 1
    and the gradient is the policy gradient's), under bfloat16 autocast (Lightning's bf16-mixed on a CPU) or not."""
    cfg = load_config(["model=tiny", "algo.kl_coef=0"])
    module = EMPO2Module(policy, tok, cfg.algo, cfg.trainer, RolloutBuffer(samples))
    micro = plan_epoch([len(s.response_ids) for s in samples], 1, len(samples), None,
                       torch.Generator().manual_seed(0))[0][0]
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        module.buffer.old_logprobs = module.score_behaviour(samples, len(samples))
        loss, _, _ = module.micro_batch_loss(micro)
    loss.backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}


def bf16_representable_tiny():
    """The tiny policy with every weight rounded to bfloat16, in float32 and as read in bfloat16: identical
    values. Parameters only, as `from_pretrained` reads a checkpoint: the rotary buffers stay float32."""
    model, tok = load_policy(ModelConfig(name="tiny"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    b16 = copy.deepcopy(model)
    for p in b16.parameters():
        p.data = p.data.bfloat16()
    return model, b16, tok


def relative_errors(grads: dict, exact: dict) -> dict[str, float]:
    return {n: float((grads[n] - exact[n]).norm() / exact[n].norm()) for n in exact if exact[n].norm() > 0}


def test_bfloat16_compute_on_float32_masters_gives_the_float32_gradient_to_bfloat16_tolerance():
    """From identical bfloat16-representable weights: read in bfloat16 and made float32 masters, the bf16-mixed
    gradient is float32, bit-identical to the one from the same weights read in float32, and equal to a float32
    (32-true) run's gradient within bfloat16 compute tolerance (relative error of each tensor <= 2e-2, 8e-3
    measured; bfloat16 keeps 8 significant bits, 4e-3 a rounding)."""
    f32, b16, tok = bf16_representable_tiny()
    samples = _samples(f32.config.vocab_size)
    float32_master_weights(b16)
    assert {p.dtype for p in b16.parameters()} == {torch.float32}
    assert b16.lm_head.weight is b16.get_input_embeddings().weight  # still tied: one parameter
    mixed = _gradient(b16, tok, samples, autocast=True)
    same = _gradient(copy.deepcopy(f32), tok, samples, autocast=True)
    exact = _gradient(f32, tok, samples, autocast=False)
    assert {g.dtype for g in mixed.values()} == {torch.float32}
    assert all(torch.equal(mixed[n], same[n]) for n in mixed)
    errors = relative_errors(mixed, exact)
    assert max(errors.values()) <= 2e-2, max(errors.items(), key=lambda kv: kv[1])
    assert max(errors.values()) > 1e-4  # the compute was bfloat16: the comparison can tell


# --------------------------------------------------------------------------------- fsdp on 2 processes
FSDP = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "torch_threads=1"]


def _probed_rank(rank: int, port: int, results, out: Path, overrides: list[str]) -> None:
    """One of two ranks of the `trainer=fsdp` run, started as torchrun starts it: trains with `overrides` and writes
    what its `DtypeProbe` saw to OUT/dtypes<rank>.json."""
    from empo2.utils import quiet_libraries

    as_torchrun_rank(rank, port)
    quiet_libraries()
    probe = DtypeProbe()
    train(load_config(overrides), callbacks=[probe])
    restored = {k: v if isinstance(v, str) else v.tolist() for k, v in probe.restored.items()}
    (out / f"dtypes{rank}.json").write_text(json.dumps({**probe.seen, "restored": restored}))
    results.put(rank)


def _fsdp_ranks(out: Path, *overrides: str) -> list[dict]:
    """A 2-process `trainer=fsdp` run on gloo: each rank's `DtypeProbe`."""
    args = [*REPRO, *FSDP, *overrides]
    assert spawn_ranks(functools.partial(_probed_rank, out=out, overrides=args), timeout=600) == [0, 1]
    return [json.loads((out / f"dtypes{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_fsdp_shards_are_float32_after_a_step_and_after_resuming_a_bfloat16_checkpoint(tmp_path, monkeypatch):
    """`trainer=fsdp` on 2 gloo processes, read in bfloat16, bf16-mixed: every rank's trainable shards and AdamW
    state are float32 DTensors after a step (each rank upcast its own shard after sharding), in the one-file
    checkpoint too; a bfloat16 checkpoint resumes into float32 shards and state on both ranks, its values restored;
    `empo2 eval` of the fsdp run plays in bfloat16."""
    run = tmp_path / "fsdp"
    first = _fsdp_ranks(tmp_path, f"run_root={tmp_path}", "run_name=fsdp")
    f32_shards = {"trainable": [F32], "frozen": [], "state": [F32], "ref": [], "ref_is_policy": False,
                  "sharded": True}
    for rank in first:
        assert {k: v for k, v in rank["step"].items() if k != "states"} == f32_shards, rank
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert {str(v.dtype) for k, v in ckpt["state_dict"].items() if k.startswith("policy.")} == {F32}
    old = old_style_checkpoint(run / "checkpoints" / "last.ckpt", tmp_path / "old.ckpt")
    resumed = _fsdp_ranks(tmp_path, f"run_root={tmp_path}", "run_name=resumed", "trainer.iterations=2",
                          f"resume={old}")
    for rank in resumed:
        assert rank["start"]["trainable"] == rank["start"]["state"] == [F32] and rank["start"]["sharded"]
        assert {k: v for k, v in rank["step"].items() if k != "states"} == f32_shards, rank
    saved = torch.load(old, map_location="cpu", weights_only=True)
    restored = resumed[0]["restored"]
    assert torch.equal(torch.tensor(restored["weight"]), saved["state_dict"][f"policy.{restored['name']}"].float())
    assert torch.equal(torch.tensor(restored["exp_avg"]), saved["optimizer_states"][0]["state"][0]["exp_avg"].float())
    assert eval_policy(run / "checkpoints" / "last.ckpt", tmp_path / "eval", monkeypatch) == ([BF16], True)
