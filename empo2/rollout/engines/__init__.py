"""Generation engines: transformers `generate` in-process (default) or a colocated vLLM (GPU)."""

from empo2.rollout.engines.base import Generation, GenerationEngine, SamplingParams, StopTokens, eos_ids
from empo2.rollout.engines.hf import HFEngine
from empo2.rollout.engines.vllm import VLLMEngine
from empo2.rollout.engines.weights import full_named_tensors


def build_engine(engine_cfg, model, tokenizer, model_path=None) -> GenerationEngine:
    """The engine an `EngineConfig` names. `vllm` needs the checkpoint directory the policy was loaded from
    (vLLM reads config and tokenizer there); it runs in the policy's dtype and gets the policy's current
    weights right away, so a resumed or LoRA-wrapped policy is what it samples from."""
    if engine_cfg.name == "hf":
        return HFEngine(model, tokenizer)
    if engine_cfg.name == "vllm":
        if model_path is None:
            raise ValueError("engine.name=vllm needs the policy's checkpoint directory (model_path)")
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        engine = VLLMEngine(str(model_path), tokenizer, gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
                            tensor_parallel_size=engine_cfg.tensor_parallel_size, sleep_mode=engine_cfg.sleep_mode,
                            dtype=dtype)
        engine.update_weights(full_named_tensors(model))
        return engine
    raise ValueError(f"unknown engine {engine_cfg.name!r}: expected 'hf' or 'vllm'")


__all__ = ["Generation", "GenerationEngine", "HFEngine", "SamplingParams", "StopTokens", "VLLMEngine",
           "build_engine", "eos_ids", "full_named_tensors"]
