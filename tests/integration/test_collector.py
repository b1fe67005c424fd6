"""RolloutWorker.collect end to end: tiny model, real MiniSci, real MiniLM + hnswlib memory."""

import numpy as np
import pytest
import torch

from empo2.config import ModelConfig
from empo2.envs import TaskSpec, make_env
from empo2.memory import TIP_HEADER, Embedder, TipMemory
from empo2.models import load_policy
from empo2.rollout.engines import HFEngine
from empo2.rollout.prompts import PromptBuilder
from empo2.rollout.spec import CollectionSpec
from empo2.rollout.worker import RolloutWorker

TASKS = [TaskSpec("find-living-thing", 0), TaskSpec("power-component", 1)]
N = 2


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(name="tiny"))


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


def make_collection(policy, embedder, template="project", engine=None, envs=None, **overrides):
    """A worker over MiniSci environments (4 steps), and the collection spec with `overrides`."""
    model, tok = policy
    spec = CollectionSpec(max_new_tokens=6, tip_max_new_tokens=16, **overrides)
    memory = TipMemory(embedder.dim, min_sim=spec.min_sim, raw_tips=spec.tip_format == "raw")
    envs = envs or [make_env("minisci", max_steps=4) for _ in range(len(TASKS) * N)]
    builder = PromptBuilder(tok, max_prompt_tokens=512, template=template)
    worker = RolloutWorker(engine or HFEngine(model, tok), builder, envs, memory, embedder, max_episode_steps=4,
                           special_tokens=tok.all_special_tokens)
    return worker, spec


def collect(worker, spec, seed=0, iteration=0):
    return worker.collect(spec, TASKS, N, iteration, torch.Generator().manual_seed(seed))


def fill_memory(worker):
    """One tip per task instance, retrievable from any state (min_sim=-1 in these tests)."""
    texts = [f"tip for {t.task} number {t.variation}: look in every room first" for t in TASKS]
    metas = [{"task": t.task, "variation": t.variation, "episode_return": 1.0, "iteration": 0, "source_rank": 0}
             for t in TASKS]
    worker.memory.add(texts, worker.embedder.encode(texts), metas)


def test_samples_are_well_formed(policy, embedder):
    model, tok = policy
    batch = collect(*make_collection(policy, embedder))
    assert len(batch.trajectories) == len(TASKS) * N
    assert len(batch.samples) == sum(tr.length for tr in batch.trajectories) > 0
    vocab = model.config.vocab_size
    for tr in batch.trajectories:
        assert 1 <= tr.length <= 4
        assert [s.step for s in tr.samples] == list(range(tr.length))
        assert len({s.advantage for s in tr.samples}) == 1  # every step carries its trajectory's advantage
        for s in tr.samples:
            assert s.group_id == tr.group_id and s.traj_id == tr.traj_id
            assert 1 <= len(s.response_ids) <= 6
            assert all(0 <= i < vocab for i in s.behaviour_ids + s.train_ids + s.response_ids)
    # advantages are centred within each group
    for g in range(len(TASKS)):
        adv = [tr.samples[0].advantage for tr in batch.trajectories if tr.group_id == g]
        assert abs(sum(adv)) < 1e-5
    for key in ("rollout/return", "rollout/success", "rollout/episode_len", "rollout/invalid_action_frac",
                "rollout/memory_frac", "rollout/offpolicy_frac", "intrinsic/mean_reward", "memory/tips_added",
                "memory/size", "rollout/tokens_generated", "time/generate_s", "time/env_s", "time/memory_s",
                "time/tips_s"):
        assert key in batch.stats, key


def test_p0_puts_no_tip_anywhere_and_p1_puts_tips_everywhere(policy, embedder):
    _, tok = policy
    header = tok(TIP_HEADER, add_special_tokens=False)["input_ids"][:3]
    c0, s0 = make_collection(policy, embedder, p=0.0, min_sim=-1.0)
    fill_memory(c0)
    b0 = collect(c0, s0)
    assert not any(s.memory or s.offpolicy for s in b0.samples)
    assert b0.stats["rollout/memory_frac"] == 0.0
    c1, s1 = make_collection(policy, embedder, p=1.0, q=0.0, min_sim=-1.0)
    fill_memory(c1)
    b1 = collect(c1, s1)
    assert all(s.memory and not s.offpolicy for s in b1.samples)
    assert all(s.train_ids == s.behaviour_ids for s in b1.samples)  # on-policy keeps the tips
    text = tok.decode(b1.samples[0].behaviour_ids)
    assert TIP_HEADER in text and "<tip>tip for" in text
    assert header and TIP_HEADER not in tok.decode(b0.samples[0].behaviour_ids)


def test_q1_updates_memory_samples_offpolicy_on_the_tip_free_prompt(policy, embedder):
    c, s = make_collection(policy, embedder, p=1.0, q=1.0, min_sim=-1.0)
    fill_memory(c)
    batch = collect(c, s)
    _, tok = policy
    for s in batch.samples:
        assert s.offpolicy and s.memory
        assert len(s.train_ids) < len(s.behaviour_ids)
        assert TIP_HEADER not in tok.decode(s.train_ids)


def test_q0_never_yields_offpolicy(policy, embedder):
    c, spec = make_collection(policy, embedder, p=1.0, q=0.0, min_sim=-1.0)
    fill_memory(c)
    assert not any(s.offpolicy for s in collect(c, spec).samples)


def test_tips_reach_memory_and_novelty_counts_persist(policy, embedder):
    c, s = make_collection(policy, embedder)
    batch = collect(c, s)
    written = {tr.tip for tr in batch.trajectories if tr.tip is not None}
    assert written, "the tiny policy wrote no acceptable tip in this seed; pick another"
    assert batch.stats["memory/tips_added"] == len(c.memory) > 0
    assert {r.text for r in c.memory.records()} <= written
    assert all(r.iteration == 0 and r.source_rank == 0 for r in c.memory.records())
    seen = len(c.novelty)
    assert seen > 0
    collect(c, s, seed=1, iteration=1)
    assert sum(c.novelty.counts.values()) > seen  # counts accumulate across iterations


def test_intrinsic_reward_reaches_the_advantages(policy, embedder):
    b0 = collect(*make_collection(policy, embedder, beta=0.0))
    b1 = collect(*make_collection(policy, embedder, beta=5.0))
    r0 = np.array([tr.ret for tr in b0.trajectories])
    r1 = np.array([tr.ret for tr in b1.trajectories])
    ext = np.array([tr.ext_return for tr in b1.trajectories])
    bonus = np.array([sum(tr.intrinsic) for tr in b1.trajectories])
    np.testing.assert_allclose(r0, [tr.ext_return for tr in b0.trajectories])
    np.testing.assert_allclose(r1, ext + 5.0 * bonus, rtol=1e-6)
    assert (bonus > 0).all()
    assert b1.stats["rollout/intrinsic_return"] == pytest.approx(5.0 * bonus.mean())
    assert b0.stats["rollout/intrinsic_return"] == 0.0


def test_retrieval_bonus_is_one_over_retrieved_plus_one_and_can_stay_out_of_the_advantages(policy, embedder):
    """algo.intrinsic=retrieval (released code): r_int = 1/(count+1) on memory-mode steps, 0 elsewhere; with
    intrinsic_in_advantage=False it is logged but the returns (hence advantages) are the extrinsic ones."""
    for in_adv in (True, False):
        c, s = make_collection(policy, embedder, p=0.5, min_sim=-1.0, top_k=1, write_tips=False, beta=5.0,
                               intrinsic="retrieval", intrinsic_in_advantage=in_adv, mode_granularity="episode")
        fill_memory(c)  # one tip per instance: a memory-mode step retrieves exactly 1 tip, r_int = 1/2
        batch = collect(c, s, seed=5)
        memory = [tr for tr in batch.trajectories if tr.samples[0].memory]
        plain = [tr for tr in batch.trajectories if not tr.samples[0].memory]
        assert memory and plain, "seed 5 gave no mix of modes; pick another"
        assert all(tr.intrinsic == [0.5] * tr.length for tr in memory)
        assert all(tr.intrinsic == [0.0] * tr.length for tr in plain)
        rets = np.array([tr.ret for tr in batch.trajectories])
        ext = np.array([tr.ext_return for tr in batch.trajectories])
        bonus = np.array([sum(tr.intrinsic) for tr in batch.trajectories])
        np.testing.assert_allclose(rets, ext + 5.0 * bonus if in_adv else ext)
        assert batch.stats["intrinsic/mean_reward"] > 0
        assert len(c.novelty) == 0  # no visit is counted for a bonus that does not use them


def test_released_wording_stores_raw_tips_and_raw_actions_in_the_released_entry_text(policy, embedder):
    """rollout.prompt_template=released with memory.tip_format=raw: the tip is the policy's output as written, one
    entry per step `<tip>; At that timestep, the specific action your took was <raw output>; Eventually you got the
    score <R>/100.`, and the chat history shows the raw outputs."""
    c, s = make_collection(policy, embedder, template="released", tip_format="raw", per_step_entries=True,
                           step_entry_key="final", key_text="history")
    batch = collect(c, s)
    records = c.memory.records()
    assert records and batch.stats["memory/tips_added"] == len(records)
    assert all(tr.tip is not None for tr in batch.trajectories)  # raw: nothing is rejected or cut
    for r in records:
        assert any(r.text == f"{tr.tip}; At that timestep, the specific action your took was {r.action}; Eventually "
                   f"you got the score {round(float(tr.score), 1)}/100." for tr in batch.trajectories
                   if (tr.task, tr.variation) == (r.task, r.variation))
    _, tok = policy
    for tr in batch.trajectories:  # the next prompt shows step 0's raw output as the past action
        firsts = [r.action for r in records if (r.task, r.variation, r.step) == (tr.task, tr.variation, 0)]
        if tr.length > 1 and firsts:
            assert any(a in tok.decode(tr.samples[1].behaviour_ids) for a in firsts)


def test_fixed_seed_reproduces_the_batch(policy, embedder):
    a = collect(*make_collection(policy, embedder, p=0.5, q=0.5), seed=7)
    b = collect(*make_collection(policy, embedder, p=0.5, q=0.5), seed=7)
    assert [(s.behaviour_ids, s.train_ids, s.response_ids, s.offpolicy, s.advantage) for s in a.samples] == \
           [(s.behaviour_ids, s.train_ids, s.response_ids, s.offpolicy, s.advantage) for s in b.samples]
    c = collect(*make_collection(policy, embedder, p=0.5, q=0.5), seed=8)
    assert [s.response_ids for s in a.samples] != [s.response_ids for s in c.samples]


def test_evaluation_mode_writes_no_tips_and_counts_no_visits(policy, embedder):
    c, s = make_collection(policy, embedder)
    batch = collect(c, s.for_scoring(mem=False, temperature=s.temperature))
    assert len(c.memory) == 0 and len(c.novelty) == 0
    assert not any(s.memory for s in batch.samples)


@pytest.mark.needs("scienceworld", "java")
def test_a_short_scienceworld_batch_on_the_real_jvm(policy, embedder):
    model, tok = policy
    envs = [make_env("scienceworld", max_steps=3) for _ in range(2)]
    try:
        spec = CollectionSpec(max_new_tokens=6, tip_max_new_tokens=12)
        worker = RolloutWorker(HFEngine(model, tok), PromptBuilder(tok, max_prompt_tokens=512), envs,
                               TipMemory(embedder.dim), embedder, 3, special_tokens=tok.all_special_tokens)
        batch = worker.collect(spec, [TaskSpec("find-living-thing", 0)], 2, 0, torch.Generator().manual_seed(0))
    finally:
        for env in envs:
            env.close()
    assert len(batch.trajectories) == 2
    assert all(1 <= tr.length <= 3 and tr.env_error is None for tr in batch.trajectories)
    assert all(0 <= tr.score <= 100 for tr in batch.trajectories)
    assert batch.stats["intrinsic/states_seen"] >= 1


def test_overlong_drop_leaves_steps_and_their_rewards_out_of_training(policy, embedder):
    """rollout.overlong=drop (released code): a step whose prompt + response exceeds the limit is no sample and its
    reward leaves the return; the episode itself (actions, score) is the same as without the limit."""
    pytest.importorskip("scienceworld")
    import shutil

    if shutil.which("java") is None:
        pytest.skip("java 17 is needed for ScienceWorld")
    model, tok = policy
    envs = [make_env("scienceworld", max_steps=3, reward_scale=1.0) for _ in range(2)]
    batches = {}
    try:
        for limit in (None, 1, "mid"):
            if limit == "mid":  # between the first prompt's length and the longest one's
                lengths = sorted(len(smp.behaviour_ids) + len(smp.response_ids) for smp in batches[None].samples)
                limit = lengths[len(lengths) // 2]
            spec = CollectionSpec(max_new_tokens=6, drop_over_tokens=limit, p=0.0, write_tips=False)
            worker = RolloutWorker(HFEngine(model, tok), PromptBuilder(tok, max_prompt_tokens=100_000), envs,
                                   TipMemory(embedder.dim), embedder, 3)
            batches[limit] = worker.collect(spec, [TaskSpec("find-living-thing", 0)], 2, 0,
                                            torch.Generator().manual_seed(0))
    finally:
        for env in envs:
            env.close()
    full, none_kept = batches.pop(None), batches.pop(1)
    (limit, some), = batches.items()
    assert [tr.score for tr in none_kept.trajectories] == [tr.score for tr in full.trajectories]
    assert sum(tr.score for tr in full.trajectories) > 0  # the task grants points: there is a reward to lose
    assert [tr.ext_return for tr in full.trajectories] == [tr.score for tr in full.trajectories]
    assert none_kept.samples == [] and all(tr.ext_return == 0 for tr in none_kept.trajectories)
    assert none_kept.stats["rollout/dropped_overlong"] == len(full.samples)
    kept = [len(smp.behaviour_ids) + len(smp.response_ids) for smp in some.samples]
    over = [n for smp in full.samples if (n := len(smp.behaviour_ids) + len(smp.response_ids)) > limit]
    assert kept and all(n <= limit for n in kept) and some.stats["rollout/dropped_overlong"] == len(over) > 0


def test_identical_rollouts_get_identical_returns_and_zero_advantages(policy, embedder):
    """Greedy decoding plays the same action script in all 8 rollouts of one instance: they reach the same
    states at the same steps, so each must get the same novelty bonus whatever its index in the group."""
    model, tok = policy
    n = 8
    spec = CollectionSpec(p=0.0, beta=0.8, temperature=0.0, max_new_tokens=6, write_tips=False)
    envs = [make_env("minisci", max_steps=4) for _ in range(n)]
    c = RolloutWorker(HFEngine(model, tok), PromptBuilder(tok, max_prompt_tokens=512), envs, None, None, 4)
    for _ in range(2):  # the second batch starts from the counts the first one left
        batch = c.collect(spec, [TaskSpec("find-living-thing", 0)], n, 0, torch.Generator().manual_seed(0))
        scripts = {tuple(tuple(s.response_ids) for s in tr.samples) for tr in batch.trajectories}
        assert len(scripts) == 1
        assert len({tuple(tr.intrinsic) for tr in batch.trajectories}) == 1
        assert len({tr.ret for tr in batch.trajectories}) == 1
        assert all(s.advantage == 0.0 for s in batch.samples)
        assert sum(batch.trajectories[0].intrinsic) > 0


def test_released_code_memory_options_tips_in_history_final_keys_and_history_text(policy, embedder):
    """empo2_official: past turns keep their tips (all cut for off-policy samples), per-step entries share the
    episode's final key, and keys are the chat-history text."""
    _, tok = policy
    c, s = make_collection(policy, embedder, p=1.0, q=1.0, min_sim=-1.0, tips_in_history=True,
                           per_step_entries=True, step_entry_key="final", key_text="history",
                           add_tips=False)  # keep the entries for inspection
    fill_memory(c)
    batch = collect(c, s)
    later = [s for s in batch.samples if s.step >= 1]
    assert later, "every episode ended after one step; pick another seed"
    for s in later:
        assert tok.decode(s.behaviour_ids).count(TIP_HEADER) == s.step + 1  # one block per turn so far
        assert TIP_HEADER not in tok.decode(s.train_ids)
    texts, vectors, metas = batch.new_tips
    assert texts
    by_episode = {}
    for text, vec, meta in zip(texts, vectors, metas):  # one key per episode, whatever the step
        by_episode.setdefault((meta["task"], meta["variation"], meta["episode_return"], meta["iteration"],
                               text.split(";")[0]), []).append(vec)
    assert all(np.allclose(v, vs[0]) for vs in by_episode.values() for v in vs)
    c_state, s_state = make_collection(policy, embedder, key_text="history")
    env = c_state.envs[0]
    env.reset(task=TASKS[0].task, variation=TASKS[0].variation)
    text = c_state.retrieval_key(s_state, env, [("obs one", "go north")], "obs two")
    assert text == f"{env.task_description}\nobs one\n> go north\nobs two"


def test_no_query_is_embedded_for_a_namespace_without_tips(policy, embedder):
    """Retrieval from an empty namespace finds nothing, so memory-mode steps there cost no embedding."""
    class Counting:
        def __init__(self, inner):
            self.inner, self.dim, self.texts = inner, inner.dim, 0

        def encode(self, texts):
            self.texts += len(texts)
            return self.inner.encode(texts)

    c, s = make_collection(policy, Counting(embedder), p=1.0, q=0.0, min_sim=-1.0, write_tips=False)
    batch = collect(c, s)
    assert c.embedder.texts == 0 and not any(s.memory for s in batch.samples)
    # every rollout wanted tips and found none: counted apart, never as tip-free, and nothing to pair
    assert batch.stats["rollout/episodes_mem_miss"] == len(TASKS) * N
    assert batch.stats["rollout/episodes_nomem"] == 0
    assert batch.stats["rollout/memory_gain_groups"] == 0 and "rollout/memory_gain" not in batch.stats
    fill_memory(c)
    c.embedder.texts = 0
    batch = collect(c, s)
    assert c.embedder.texts == len(batch.samples) and all(s.memory for s in batch.samples)
    assert batch.stats["rollout/score_mem"] == batch.stats["rollout/score"]
    assert "rollout/score_nomem" not in batch.stats  # every rollout carried tips


def tips_shown_not_returned_for_a_tip_request(worker, s, tok) -> tuple[set[str], set[str]]:
    """Two collections, the second retrieving what the first wrote: the tips its prompts show, and those of them
    that are not the (sanitised) decoding of token ids the engine returned for a tip request (`StopTokens.returned`,
    the engine's own record, apart from anything the worker keeps)."""
    from empo2.memory import sanitize_tip

    returned = worker.engine.stops.keep_record()
    collect(worker, s)
    second = collect(worker, s, seed=1, iteration=1)
    written = {sanitize_tip(tok.decode(ids, skip_special_tokens=True).strip(), s.max_tip_words, tok.all_special_tokens)
               for kind, ids in returned if kind == "tip"}
    shown = set()
    for sample in second.samples:
        text = tok.decode(sample.behaviour_ids)
        shown |= {line[len("<tip>"):-len("</tip>")] for line in text.splitlines()
                  if line.startswith("<tip>") and line.endswith("</tip>")}
    return shown, shown - written


def test_every_tip_in_a_prompt_was_written_by_the_policy(policy, embedder):
    """At run time the memory holds only what the policy wrote: no environment state reaches a prompt
    through a tip (the priors' hindsight tips exist only in their training data)."""
    _, tok = policy
    shown, foreign = tips_shown_not_returned_for_a_tip_request(*make_collection(policy, embedder, p=1.0, q=0.0,
                                                                                min_sim=-1.0), tok)
    assert shown, "no tip reached a prompt in this seed; pick another"
    assert foreign == set()


def test_a_tip_the_policy_did_not_write_is_caught(policy, embedder, monkeypatch):
    """The mutant the check above exists for: the worker stores a tip the policy did not write (a fixed text,
    standing for one built from the task and the observation)."""
    import empo2.rollout.worker as worker_module

    _, tok = policy
    monkeypatch.setattr(worker_module, "sanitize_tip", lambda text, *a: "find the living thing")
    shown, foreign = tips_shown_not_returned_for_a_tip_request(*make_collection(policy, embedder, p=1.0, q=0.0,
                                                                                min_sim=-1.0), tok)
    assert shown and foreign == shown


class RecordingEngine(HFEngine):
    """The real HF engine, keeping each call's prompts and sampling parameters."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def generate(self, prompts, params, seed=None):
        self.calls.append((prompts, params))
        return super().generate(prompts, params, seed=seed)


def test_tips_are_written_at_the_tip_temperature(policy, embedder):
    """`tip_temperature` is the tip call's temperature, apart from the acting one; at 0 the tip is the greedy
    decoding of the request, whatever the seed."""
    from empo2.memory import sanitize_tip

    model, tok = policy
    c, s = make_collection(policy, embedder, engine=RecordingEngine(model, tok), tip_temperature=0.0)
    batch = collect(c, s)
    prompts, params = c.engine.calls[-1]  # the tips are the last call of a collection, one batch for all
    assert params.temperature == 0.0 and params.max_new_tokens == s.tip_max_new_tokens
    assert all(p.temperature == s.temperature for _, p in c.engine.calls[:-1])
    again = HFEngine(model, tok).generate(prompts, params, seed=12345)
    assert [sanitize_tip(g.text, s.max_tip_words, tok.all_special_tokens) for g in again] == \
           [tr.tip for tr in batch.trajectories]


def test_memory_gain_sets_tips_against_tip_free_rollouts_of_the_same_group(policy, embedder):
    """The logged `rollout/memory_gain`: per group holding both kinds, mean score with tips minus tip-free."""
    c, s = make_collection(policy, embedder, p=0.5, q=0.0, min_sim=-1.0, write_tips=False)
    fill_memory(c)
    for seed in range(20):  # a draw with a group of both kinds
        batch = collect(c, s, seed=seed)
        by_group = {}
        for tr in batch.trajectories:
            assert tr.wanted_tips == tr.carried_tips  # the memory holds a tip for every instance
            by_group.setdefault(tr.group_id, ([], []))[0 if tr.carried_tips else 1].append(tr.score)
        mixed = [np.mean(a) - np.mean(b) for a, b in by_group.values() if a and b]
        if mixed:
            break
    assert mixed, "no draw of 20 mixed tips and tip-free rollouts in a group"
    assert batch.stats["rollout/memory_gain_groups"] == len(mixed)
    assert batch.stats["rollout/memory_gain"] == pytest.approx(np.mean(mixed))
    assert batch.stats["rollout/episodes_mem"] + batch.stats["rollout/episodes_nomem"] == len(TASKS) * N


class LongerGroupEngine(RecordingEngine):
    """The HF engine as one member of a tensor-parallel group whose other members play `extra` steps more."""

    def __init__(self, *args, extra: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.extra = extra

    def group_has_work(self, has_work):
        if has_work:
            return True
        self.extra -= 1
        return self.extra >= 0


def test_a_rank_whose_episodes_ended_keeps_joining_its_groups_generate_calls(policy, embedder):
    """The lock-step loop runs while any member of the engine's group has live episodes: this rank sends empty
    action calls until the group is done (then its tip call), and its own rollouts are those it plays alone."""
    model, tok = policy
    # episodes of 2 steps within the loop's bound of 4: room for the group's 2 more
    alone, s = make_collection(policy, embedder, engine=RecordingEngine(model, tok), tip_temperature=0.5,
                               envs=[make_env("minisci", max_steps=2) for _ in range(len(TASKS) * N)])
    grouped, _ = make_collection(policy, embedder, engine=LongerGroupEngine(model, tok, extra=2), tip_temperature=0.5,
                                 envs=[make_env("minisci", max_steps=2) for _ in range(len(TASKS) * N)])
    a, b = collect(alone, s, seed=3), collect(grouped, s, seed=3)
    own = alone.engine.calls
    assert grouped.engine.calls[:len(own) - 1] == own[:-1]
    assert [(prompts, params.kind) for prompts, params in grouped.engine.calls[len(own) - 1:-1]] == [([], "action")] * 2
    assert grouped.engine.calls[-1] == own[-1] and own[-1][1].kind == "tip"
    assert [(s.behaviour_ids, s.response_ids, s.advantage) for s in a.samples] == \
           [(s.behaviour_ids, s.response_ids, s.advantage) for s in b.samples]
    assert [tr.tip for tr in a.trajectories] == [tr.tip for tr in b.trajectories]
