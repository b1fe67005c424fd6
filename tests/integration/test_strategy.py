import lightning as L
import pytest
import torch

from empo2.config import load_config
from empo2.lit.strategy import FSDP2Strategy, build_strategy, decoder_layer_classes, hf_model
from empo2.models import load_policy
from empo2.workflows.preflight import preflight

CPU_FSDP = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


@pytest.fixture(scope="module")
def tiny():
    return load_policy(load_config(["model=tiny"]).model)[0]


def test_fsdp_preset_builds_the_fsdp2_strategy_sharding_decoder_layers(tiny):
    from lightning.pytorch.strategies import ModelParallelStrategy

    cfg = load_config(["trainer=fsdp", "model=tiny"])
    strategy = build_strategy(cfg, tiny)
    assert isinstance(strategy, FSDP2Strategy) and isinstance(strategy, ModelParallelStrategy)
    assert not strategy._save_distributed_checkpoint  # one full checkpoint file, not a folder of shards
    assert strategy.mixed_precision and cfg.trainer.precision == "bf16-mixed"  # bfloat16 gathers, on a GPU only
    assert [c.__name__ for c in decoder_layer_classes(tiny)] == ["Qwen2DecoderLayer"]
    assert not build_strategy(load_config(["model=tiny", *CPU_FSDP]), tiny).mixed_precision


def test_the_root_unit_of_a_lora_policy_is_the_wrapped_model():
    lora = load_policy(load_config(["model=tiny", "model.lora_r=4"]).model)[0]
    root = hf_model(lora)
    assert root is lora.get_base_model() and type(root).__name__ == "Qwen2ForCausalLM"
    assert [c.__name__ for c in decoder_layer_classes(root)] == ["Qwen2DecoderLayer"]


def test_preflight_accepts_fsdp_on_cpu(tmp_path):
    preflight(load_config(["model=tiny", *CPU_FSDP, f"run_root={tmp_path}"]))


def test_other_strategies_pass_through_by_name(tiny):
    assert build_strategy(load_config(["model=tiny"]), tiny) == "auto"
    assert build_strategy(load_config(["model=tiny", "trainer=ddp"]), tiny) == "ddp"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device (benchmarks/gpu_smoke.py runs fsdp there)")
def test_fsdp_trainer_builds_on_gpu(tiny):
    cfg = load_config(["trainer=fsdp", "model=tiny"])
    trainer = L.Trainer(strategy=build_strategy(cfg, tiny), accelerator="gpu", devices=1, logger=False,
                        precision=cfg.trainer.precision)
    assert type(trainer.strategy).__name__ == "FSDP2Strategy"
