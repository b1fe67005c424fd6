import lightning as L
import pytest
import torch

from empo2.config import load_config
from empo2.lit.strategy import build_strategy, decoder_layer_classes
from empo2.models import load_policy


@pytest.fixture(scope="module")
def tiny():
    return load_policy(load_config(["model=tiny"]).model)[0]


def test_fsdp_preset_wraps_decoder_layers(tiny):
    from lightning.pytorch.strategies import FSDPStrategy

    cfg = load_config(["trainer=fsdp", "model=tiny", "model.gradient_checkpointing=true"])
    strategy = build_strategy(cfg, tiny)
    assert isinstance(strategy, FSDPStrategy)
    layers = decoder_layer_classes(tiny)
    assert [c.__name__ for c in layers] == ["Qwen2DecoderLayer"]
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == layers
    assert strategy._activation_checkpointing_kwargs  # gradient checkpointing -> activation checkpointing
    assert cfg.trainer.precision == "bf16-mixed"


def test_other_strategies_pass_through_by_name(tiny):
    assert build_strategy(load_config(["model=tiny"]), tiny) == "auto"
    assert build_strategy(load_config(["model=tiny", "trainer=ddp"]), tiny) == "ddp"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP needs CUDA (benchmarks/gpu_smoke.py runs it)")
def test_fsdp_trainer_builds_on_gpu(tiny):
    cfg = load_config(["trainer=fsdp", "model=tiny"])
    trainer = L.Trainer(strategy=build_strategy(cfg, tiny), accelerator="gpu", devices=1, logger=False,
                        precision=cfg.trainer.precision)
    assert type(trainer.strategy).__name__ == "FSDPStrategy"
