import pytest
import torch

from empo2.config import ConfigError, ModelConfig
from empo2.models import load_policy


def _chat_generate(model, tok, n=8):
    enc = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=n, do_sample=False)
    return out[0, enc["input_ids"].shape[1]:], tok.decode(out[0, enc["input_ids"].shape[1]:])


def test_tiny_model_is_deterministic_and_generates_from_a_chat_prompt():
    m1, tok = load_policy(ModelConfig(name="tiny", seed=3))
    m2, _ = load_policy(ModelConfig(name="tiny", seed=3))
    m3, _ = load_policy(ModelConfig(name="tiny", seed=4))
    sd1, sd2, sd3 = m1.state_dict(), m2.state_dict(), m3.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert not all(torch.equal(sd1[k], sd3[k]) for k in sd1)
    assert "<|im_start|>user" in tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    ids, text = _chat_generate(m1, tok)
    assert len(ids) > 0 and isinstance(text, str)


def test_hf_missing_path_says_what_to_download(tmp_path):
    with pytest.raises(ConfigError, match="huggingface-cli download Qwen/Qwen2.5-7B-Instruct"):
        load_policy(ModelConfig(name="qwen2.5-7b", path=str(tmp_path / "nope")))


def test_hf_loads_a_local_checkpoint(tmp_path):
    model, tok = load_policy(ModelConfig(name="tiny"))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, ltok = load_policy(ModelConfig(name="hf", path=str(tmp_path)))
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert ltok.chat_template == tok.chat_template


def test_a_checkpoint_the_project_wrote_loads_with_the_tokenizer_it_was_saved_with(tmp_path):
    """The priors are Qwen2-shaped with their own byte-level BPE: loaded through AutoTokenizer they got
    Qwen2Tokenizer's pre-tokenizer, which splits numbers into digits, so run-time prompts (scores, terminals,
    temperatures, "100 words") were not the ones the policy was trained on."""
    from empo2.models.io import load_local, save_cached_checkpoint

    model, tok = load_policy(ModelConfig(name="tiny"))
    save_cached_checkpoint(model, tok, {"test": True}, tmp_path / "ckpt")
    _, loaded = load_local(tmp_path / "ckpt", torch.float32)
    text = "connect battery anode to the red light bulb terminal 1. Final score 100; 23.5 degrees"
    assert loaded(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert loaded.chat_template == tok.chat_template and loaded.eos_token == tok.eos_token
    assert set(loaded.all_special_tokens) == set(tok.all_special_tokens)


def test_lora_wraps_the_policy_and_trains_only_adapters():
    model, _ = load_policy(ModelConfig(name="tiny", lora_r=4))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


@pytest.mark.slow
def test_bundled_smollm2_converts_once_and_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path))
    model, tok = load_policy(ModelConfig(name="smollm2"))
    cache = tmp_path / "models" / "smollm2"
    assert (cache / "model.safetensors").is_file() and (cache / "empo2_source.json").is_file()
    assert not [p for p in cache.parent.iterdir() if p.name.startswith(".tmp-")]  # no half-written leftovers
    _, text = _chat_generate(model, tok, n=12)
    assert "hello" in text.lower() or "hi" in text.lower(), text
    # a cache without its completion marker is rebuilt, never trusted
    (cache / "empo2_source.json").unlink()
    model2, _ = load_policy(ModelConfig(name="smollm2"))
    assert (cache / "empo2_source.json").is_file()
    assert torch.equal(model2.lm_head.weight, model.lm_head.weight)


def test_a_recipe_built_prior_not_built_here_stops_with_the_command_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("EMPO2_CACHE", str(tmp_path))  # an empty cache: nothing built on this machine
    build = "`python -m recipes.minisci_priors.prior_rounds build minisci_bc`"
    with pytest.raises(ConfigError, match=rf"^model.name=minisci_bc is not built on this machine: {build} builds it"):
        load_policy(ModelConfig(name="minisci_bc"))
