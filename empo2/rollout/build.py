"""What a config makes of the rollout side: the environments' arguments, the validation tasks, and the
`RolloutWorker` (engine, prompt builder, environments, tip memory, novelty counter) that training, evaluation and the
priors' self-play all collect with (what each call collects: `empo2.rollout.spec`)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

from empo2.config import TrainConfig, own_env_fields
from empo2.envs import TaskSpec, TextEnv, get_catalogue, make_env
from empo2.memory import Embedder, TipMemory
from empo2.rollout.engines import build_engine
from empo2.rollout.prompts import PromptBuilder
from empo2.rollout.worker import RolloutWorker


def env_kwargs(cfg: TrainConfig) -> dict:
    """Constructor arguments of the configured environment: the common ones, then every setting of its own config
    class (the MiniSci house, ScienceWorld's simplification, ...), each named as the constructor names it."""
    kw = {"action_correction": cfg.env.action_correction, "reward_scale": cfg.env.reward_scale}
    if cfg.env.max_steps is not None:
        kw["max_steps"] = cfg.env.max_steps
    kw.update({f: getattr(cfg.env, f) for f in own_env_fields(type(cfg.env))})
    return kw


def validation_task_types(cfg: TrainConfig) -> list[str]:
    """The task types validation plays: `env.val_tasks`, else those the run trains on (`env.tasks`), else
    `env.val_default_tasks`, else every in-distribution task of the catalogue."""
    return list(cfg.env.val_tasks or cfg.env.tasks or cfg.env.val_default_tasks
                or get_catalogue(cfg.env.name).tasks())


def validation_tasks(cfg: TrainConfig, on_train: bool = False) -> list[TaskSpec]:
    """The fixed validation list: the first `val_variations` variations of `val_split` for every validation task
    type (`validation_task_types`), so two runs (and two iterations of one run) are always scored on the same
    instances. With `on_train`, the first ones of the variations the run trains on (`train_split`, within
    `train_variations`). Each held-out instance appears `val_repeats` times in a row."""
    cat = get_catalogue(cfg.env.name)
    split, n = cfg.env.val_split, cfg.env.val_variations
    if on_train:
        split, n = cfg.env.train_split, min(n, cfg.env.train_variations or n)
    repeats = 1 if on_train else cfg.env.val_repeats  # each instance played that many times (released code: 4)
    return [TaskSpec(t, v) for t in validation_task_types(cfg) for v in cat.split(t, split)[:n] for _ in range(repeats)]


def episode_step_bound(cfg: TrainConfig, env) -> int:
    """How many lock-step steps a collection may run: `env.max_steps`, else the longest per-task budget of
    the run's training and validation task types where the environment has a budget table (ScienceWorld's reach
    880 steps), and never below 100 (the environments end their episodes themselves; the bound is also the width
    of the mode draws, so it stays fixed for a given config)."""
    if cfg.env.max_steps is not None:
        return cfg.env.max_steps
    budget = getattr(env, "budget", None)
    if budget is None:
        return 100
    tasks = cfg.env.tasks or get_catalogue(cfg.env.name).tasks()
    return max(100, *(budget(t) for t in [*tasks, *validation_task_types(cfg)]))


# What a tip line adds to the tip's own tokens (its `<tip>` tags, newline and, in an entry, the score text), and
# what the block's header and separator take once: both stay well under these on the shipped tokenizers
# (SmolLM2, Qwen2.5), which take 10-20 and ~15 tokens.
TIP_LINE_TOKENS = 32
TIP_HEADER_TOKENS = 32


def trainer_compute_dtype(cfg: TrainConfig) -> str:
    """The precision the update computes in: bfloat16 under `bf16-mixed` (autocast), else float32.
    Read from `trainer.precision` alone, never from the weights' dtype (`model.dtype` names how they are read)."""
    return "bfloat16" if cfg.trainer.precision == "bf16-mixed" else "float32"


def engine_dtype(cfg: TrainConfig) -> str:
    """`engine.dtype` resolved: `auto` is the trainer's compute precision."""
    return trainer_compute_dtype(cfg) if cfg.engine.dtype == "auto" else cfg.engine.dtype


def generation_logprobs_exact(cfg: TrainConfig) -> bool:
    """Whether `generate` samples from the distribution the update scores as the behaviour policy, to float32
    rounding, so that its log-probs can replace the scoring pass: the engine computes in the trainer's precision and
    that precision is float32 (a 32-true trainer, the engine at float32: HF on the policy module itself, vLLM on
    weights synced before every rollout), and the whole vocabulary is sampled (`top_p` = 1: a nucleus renormalises
    vLLM's log-probs). Two bfloat16 passes of different shapes (a KV-cached decode step and a whole-sequence
    forward, or another engine's kernels) differ by bfloat16 rounding, far more than the float32 rounding the
    first ratio's 1 tolerates, so a bfloat16 trainer always runs the pass. The temperature is the rollout's on
    both sides."""
    return (cfg.rollout.generation_logprobs and trainer_compute_dtype(cfg) == "float32"
            and engine_dtype(cfg) == "float32" and cfg.rollout.top_p == 1)


def records_engine_logprobs(cfg: TrainConfig) -> bool:
    """Whether training rollouts keep the engine's log-prob of every sampled token (`StepSample.engine_logprobs`):
    always with vLLM (under `top_p` < 1 its processed log-probs, renormalised over the nucleus: the distribution it
    sampled from), with HF under `top_p` = 1 (HF's recorder reads the whole vocabulary, before the nucleus); and
    always in the exact mode, where they are the old log-probs."""
    return cfg.engine.name == "vllm" or cfg.rollout.top_p == 1 or generation_logprobs_exact(cfg)


def tip_block_tokens(cfg: TrainConfig) -> int:
    """The most tokens the tip block of an action prompt may take: at most `top_k` tips, each at most
    `tip_max_new_tokens` as the policy wrote it (a per-step entry adds the step's action, at most `max_new_tokens`),
    with `TIP_LINE_TOKENS` of markup each and `TIP_HEADER_TOKENS` once. Text re-encoded can take more tokens than
    were generated (and a corrected action more than `max_new_tokens`), so the worker keeps only the leading tips
    whose block fits (`PromptBuilder.tips_that_fit`): the bound holds by construction, not by assumption."""
    r, m = cfg.rollout, cfg.memory
    per_tip = r.tip_max_new_tokens + TIP_LINE_TOKENS + (r.max_new_tokens if m.per_step_entries else 0)
    return TIP_HEADER_TOKENS + m.top_k * per_tip


def max_request_tokens(cfg: TrainConfig) -> int | None:
    """The largest request (prompt + response tokens) a rollout can make, or None where prompts are unbounded
    (`rollout.overlong=drop` prompts with whole histories; `rollout.tips_in_history` keeps tip blocks on top of the
    budget in every past turn). An action prompt is at most `max_prompt_tokens` without its tip block (the
    `PromptBuilder` budget), plus the block (`tip_block_tokens`), then `max_new_tokens`. The tip request is at most
    its own budget (tip-free), then `tip_max_new_tokens`."""
    r = cfg.rollout
    if r.overlong == "drop" or r.tips_in_history:
        return None
    action = r.max_prompt_tokens + (tip_block_tokens(cfg) if cfg.memory.enabled else 0) + r.max_new_tokens
    request = (r.max_tip_request_tokens or r.max_prompt_tokens) + r.tip_max_new_tokens
    return max(action, request)


def engine_for(cfg: TrainConfig, model, tokenizer):
    """The generation engine of a config: `engine.*` with its dtype resolved and vLLM's longest request
    (`engine.max_model_len`, else `max_request_tokens`)."""
    return build_engine(cfg.engine, model, tokenizer, seed=cfg.seed, dtype=engine_dtype(cfg),
                        max_model_len=cfg.engine.max_model_len or max_request_tokens(cfg))


def start_envs(cfg: TrainConfig, n: int) -> list[TextEnv]:
    """`n` environments of the config, started side by side: a ScienceWorld environment starts its own JVM, a
    second or more of a core each, which started one after another add up (and training starts them beside the
    model's load). Where one fails to start, those that did are closed before the error is raised."""
    with ThreadPoolExecutor(max_workers=max(n, 1), thread_name_prefix="empo2-env-start") as pool:
        futures = [pool.submit(make_env, cfg.env.name, **env_kwargs(cfg)) for _ in range(n)]
    envs = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for env in envs:
            env.close()
        raise failed[0]
    return envs


def build_worker(cfg: TrainConfig, model, tokenizer, envs: int | list[TextEnv],
                 with_engine: bool = True) -> RolloutWorker:
    """The rollout worker of a config, with `envs` (started environments, or how many to start here);
    `with_engine=False` leaves the engine for the caller to attach (training builds it with `engine_for` once the
    strategy has opened the process group: `RolloutCallback.setup`)."""
    engine = engine_for(cfg, model, tokenizer) if with_engine else None
    drop = cfg.rollout.overlong == "drop"  # whole histories; over-long steps leave training in the worker
    builder = PromptBuilder(tokenizer, max_prompt_tokens=sys.maxsize if drop else cfg.rollout.max_prompt_tokens,
                            history_turns=cfg.rollout.history_turns,
                            max_request_tokens=cfg.rollout.max_tip_request_tokens or cfg.rollout.max_prompt_tokens,
                            template=cfg.rollout.prompt_template)
    envs = start_envs(cfg, envs) if isinstance(envs, int) else envs
    memory = embedder = None
    if cfg.memory.enabled:
        embedder = Embedder(cfg.memory.embedder_path)
        m = cfg.memory
        memory = TipMemory(embedder.dim, namespace=m.namespace, capacity_per_namespace=m.capacity,
                           eviction=m.eviction, min_sim=m.min_sim, top_k=m.top_k, utility_weight=m.utility_weight,
                           rank_by=m.rank_by, ef_search=m.ef_search, seed=cfg.seed, raw_tips=m.tip_format == "raw")
    specials = list(getattr(tokenizer, "all_special_tokens", []))
    return RolloutWorker(engine, builder, envs, memory, embedder, episode_step_bound(cfg, envs[0]),
                         special_tokens=specials)
