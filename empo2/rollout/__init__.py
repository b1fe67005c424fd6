"""Rollouts: prompt building, generation engines (HF, vLLM), the per-call collection spec and the worker that
plays the environments."""

from empo2.rollout.engines import (
    Generation,
    GenerationEngine,
    HFEngine,
    SamplingParams,
    VLLMEngine,
    build_engine,
    full_named_tensors,
)
from empo2.rollout.prompts import DEFAULT_SYSTEM_PROMPT, ChatTemplateError, Prompt, PromptBuilder

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "ChatTemplateError",
    "Generation",
    "GenerationEngine",
    "HFEngine",
    "Prompt",
    "PromptBuilder",
    "SamplingParams",
    "VLLMEngine",
    "build_engine",
    "full_named_tensors",
]
