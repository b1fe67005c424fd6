"""Each kind of rollout call gets its collection spec from the config, frozen: what training, validation, evaluation
and adaptation play is a function of the config (and the iteration), never of an earlier call."""

import dataclasses

import pytest

from empo2.config import load_config
from empo2.rollout.spec import adaptation_spec, collection_spec, scoring_spec, training_spec


@pytest.fixture(scope="module")
def cfg():
    return load_config(["model=tiny", "trainer.iterations=5", "algo.p=0.3", "algo.q=0.6", "algo.beta_start=0.8",
                        "algo.beta_end=0.2", "rollout.temperature=0.9", "rollout.val_temperature=0.4",
                        "rollout.overlong=drop", "rollout.max_prompt_tokens=300"])


def test_a_spec_cannot_be_changed_after_it_is_built(cfg):
    spec = training_spec(cfg, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.p = 1.0


def test_the_config_reaches_the_spec(cfg):
    spec = collection_spec(cfg)
    assert (spec.p, spec.q, spec.temperature, spec.beta) == (0.3, 0.6, 0.9, 0.8)
    assert (spec.top_k, spec.min_sim, spec.tip_format) == (cfg.memory.top_k, cfg.memory.min_sim, cfg.memory.tip_format)
    assert spec.drop_over_tokens == 300 and not spec.scoring and spec.write_tips and spec.add_tips
    assert collection_spec(cfg, write_tips=False, q=1.0) == dataclasses.replace(spec, write_tips=False, q=1.0)


def test_training_specs_follow_the_beta_schedule_and_share_tips_under_data_parallelism(cfg):
    assert [training_spec(cfg, it).beta for it in range(5)] == pytest.approx([0.8, 0.65, 0.5, 0.35, 0.2])
    assert training_spec(cfg, 2) == dataclasses.replace(collection_spec(cfg), beta=pytest.approx(0.5))
    assert training_spec(cfg, 0).add_tips and not training_spec(cfg, 0, world_size=2).add_tips


def test_scoring_specs_play_all_or_no_rollouts_with_tips_at_the_validation_temperature(cfg):
    for mem, p in ((True, 1.0), (False, 0.0)):
        spec = scoring_spec(cfg, mem)
        assert spec.scoring and spec.p == p and spec.temperature == 0.4
        assert not spec.write_tips and spec.drop_over_tokens is None and not spec.record_logprobs


def test_adaptation_puts_tips_in_every_prompt_and_leaves_adding_them_to_the_trial(cfg):
    one = load_config(["model=tiny", "trainer.iterations=1"])  # where the schedule's only iteration is its end
    spec = adaptation_spec(one)
    assert (spec.p, spec.q, spec.temperature, spec.add_tips, spec.scoring) == (1.0, 0.0, 0.4, False, False)
    assert spec.beta == one.algo.beta_start != training_spec(one, 0).beta

