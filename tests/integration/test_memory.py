"""TipMemory on a real hnswlib index, with real all-MiniLM-L6-v2 embeddings where meaning matters."""

import json
import os
import warnings

import numpy as np
import pytest

from empo2.memory import Embedder, TipMemory, episode_entries, step_entry_text

TIPS = {
    "boil": "Put water in the pot, place it on the stove and turn the stove on to boil the water.",
    "plant": "To grow a plant, put a seed in a flower pot filled with soil and water it.",
    "circuit": "Connect the battery to the light bulb with wires to close the electrical circuit.",
    "animal": "Animals such as the frog and the turtle can be found outside near the pond.",
    "thermo": "Use the thermometer on the substance to read its temperature.",
}
QUERIES = {
    "boil": "How can I heat water until it boils?",
    "plant": "I need to make a seed grow.",
    "circuit": "How do I power the light bulb with electricity?",
    "animal": "Where do I find a living creature?",
    "thermo": "measure how hot the liquid is",
}


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture(scope="module")
def tip_vectors(embedder):
    return embedder.encode(list(TIPS.values())), embedder.encode(list(QUERIES.values()))


def unit(rng, n, dim=16):
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def structured(rng, n, dim=384, latent=16, noise=0.05):
    """Random unit vectors with low intrinsic dimension, as sentence embeddings have.

    i.i.d. Gaussian vectors in 384 dimensions have no neighbourhood structure (the 1st and the
    100th neighbour are almost equally far), so exact top-10 there is noise, not a target.
    """
    basis = np.random.default_rng(1234).standard_normal((latent, dim))
    v = rng.standard_normal((n, latent)) @ basis + noise * rng.standard_normal((n, dim))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def filled(n=6, dim=16, **kwargs):
    memory = TipMemory(dim=dim, **kwargs)
    vecs = unit(np.random.default_rng(0), n, dim)
    ids = memory.add([f"tip {i}" for i in range(n)], vecs, [{"task": "t", "variation": 0}] * n)
    return memory, vecs, ids


# ----------------------------------------------------------------------------- embedder


def test_embedder_gives_unit_float32_rows(embedder):
    out = embedder.encode(["a short tip", "another, longer tip about boiling water on the stove"])
    assert embedder.dim == 384 and out.shape == (2, 384) and out.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    assert embedder.encode([]).shape == (0, 384)


def test_embedder_batches_do_not_change_vectors(embedder):
    texts = [f"tip number {i} about the kitchen" for i in range(5)]
    small = Embedder(embedder.path, batch_size=2)
    np.testing.assert_allclose(small.encode(texts), embedder.encode(texts), atol=1e-5)


def test_embedder_embeds_a_repeated_text_once(embedder, monkeypatch):
    texts = ["the frog is outside", "go to the kitchen", "the frog is outside", "the frog is outside"]
    seen = []
    real = embedder.model.encode
    monkeypatch.setattr(embedder.model, "encode", lambda batch, **kw: seen.append(list(batch)) or real(batch, **kw))
    out = embedder.encode(texts)
    assert seen == [["the frog is outside", "go to the kitchen"]]
    np.testing.assert_array_equal(out[0], out[2])
    np.testing.assert_array_equal(out[0], out[3])
    np.testing.assert_allclose(out[:2], embedder.encode(texts[:2]), atol=1e-6)


def test_embedder_missing_model_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        Embedder(tmp_path / "nope")


# ----------------------------------------------------------------------------- semantics


def test_semantically_closest_tip_comes_first(tip_vectors):
    tip_vecs, query_vecs = tip_vectors
    memory = TipMemory(dim=384, namespace="task")
    memory.add(list(TIPS.values()), tip_vecs, [{"task": "sci"}] * len(TIPS))
    results = memory.search(query_vecs, "sci", min_sim=-1.0)
    for name, hits in zip(QUERIES, results):
        assert hits[0][0].text == TIPS[name]
        sims = [s for _, s in hits]
        assert sims == sorted(sims, reverse=True) and len(hits) == len(TIPS)


def test_min_sim_filters(embedder, tip_vectors):
    tip_vecs, query_vecs = tip_vectors
    memory = TipMemory(dim=384, namespace="global")
    memory.add(list(TIPS.values()), tip_vecs, [{"task": "sci"}] * len(TIPS))
    unrelated = embedder.encode(["The stock market closed higher on Friday."])
    assert memory.search(unrelated, "*", min_sim=-1.0)[0]  # there are tips, all of them unrelated
    assert memory.search(unrelated, "*")[0] == []  # default min_sim 0.5 drops them
    everything = memory.search(query_vecs[:1], "*", min_sim=-1.0)[0]
    cut = (everything[0][1] + everything[1][1]) / 2
    assert [h[0].id for h in memory.search(query_vecs[:1], "*", min_sim=cut)[0]] == [everything[0][0].id]
    assert len(memory.search(query_vecs[:1], "*", k=2, min_sim=-1.0)[0]) == 2


def test_namespaces_isolate(tip_vectors):
    tip_vecs, query_vecs = tip_vectors
    memory = TipMemory(dim=384, namespace="variation")
    memory.add([TIPS["boil"]], tip_vecs[:1], [{"task": "boil", "variation": 0}])
    memory.add([TIPS["plant"], TIPS["thermo"]], tip_vecs[[1, 4]], [{"task": "boil", "variation": 1}] * 2)
    keys = [memory.namespace_key("boil", 1), memory.namespace_key("boil", 0), memory.namespace_key("grow", 0)]
    hits = memory.search(np.repeat(query_vecs[:1], 3, axis=0), keys, min_sim=-1.0)
    assert {h[0].text for h in hits[0]} == {TIPS["plant"], TIPS["thermo"]}
    assert [h[0].text for h in hits[1]] == [TIPS["boil"]]
    assert hits[2] == []
    assert memory.size("boil/1") == 2 and memory.size("boil/0") == 1 and len(memory) == 3


def test_per_step_entries_are_stored_and_found(embedder):
    meta = {"task": "boil", "variation": 0, "episode_return": 70.0}
    texts, metas = episode_entries("boil water on the stove", meta, per_step=True,
                                   actions=["go to kitchen", "activate stove"])
    memory = TipMemory(dim=384)
    ids = memory.add(texts, embedder.encode(["kitchen", "stove"]), metas)
    hit = memory.search(embedder.encode(["turn on the stove"]), "boil/0", min_sim=0.0)[0][0][0]
    assert hit.id == ids[1] and hit.action == "activate stove" and hit.step == 1
    assert hit.text == step_entry_text("boil water on the stove", "activate stove", 70.0)


# ----------------------------------------------------------------------------- recall


@pytest.fixture(scope="module")
def big_memory():
    rng = np.random.default_rng(0)
    data, queries = structured(rng, 20_000), structured(rng, 200)
    memory = TipMemory(dim=384, namespace="global", capacity_per_namespace=20_000)
    memory.add([f"t{i}" for i in range(len(data))], data, [{"task": "x"}] * len(data))
    return memory, data, queries


def recall_at_10(memory, data, queries):
    exact = np.argsort(-(queries @ data.T), axis=1)[:, :10]
    found = memory.search(queries, "*", k=10, min_sim=-1.0)
    return np.mean([len({h[0].id for h in f} & set(e.tolist())) / 10 for f, e in zip(found, exact)])


def test_recall_at_10_against_exact_search(big_memory):
    assert recall_at_10(*big_memory) >= 0.95


def test_save_load_round_trip_gives_identical_results(big_memory, tmp_path):
    memory, data, queries = big_memory
    memory.save(tmp_path / "mem")
    loaded = TipMemory.load(tmp_path / "mem")
    before = memory.search(queries, "*", k=10, min_sim=-1.0)
    after = loaded.search(queries, "*", k=10, min_sim=-1.0)
    # Identical ids and sims also show ef was restored: hnswlib reloads with ef=10.
    assert [[(r.id, s) for r, s in q] for q in after] == [[(r.id, s) for r, s in q] for q in before]
    assert loaded.records() == memory.records()
    assert sorted(os.listdir(tmp_path)) == ["mem"]  # no temp directories left behind


# ----------------------------------------------------------------------------- lifecycle


def test_capacity_evicts_oldest_first():
    memory, vecs, ids = filled(6, capacity_per_namespace=4)
    assert ids == [0, 1, 2, 3]  # a batch over capacity keeps its last entries
    assert [r.text for r in memory.records()] == ["tip 2", "tip 3", "tip 4", "tip 5"]
    new = memory.add(["tip 6"], unit(np.random.default_rng(1), 1), [{"task": "t", "variation": 0}])
    assert [r.text for r in memory.records()] == ["tip 3", "tip 4", "tip 5", "tip 6"]
    assert new == [4] and memory.size("t/0") == 4
    assert memory.add(["other"], vecs[:1], [{"task": "t", "variation": 1}]) == [5]
    assert memory.size("t/0") == 4 and memory.size("t/1") == 1  # capacity is per namespace


def test_capacity_evicts_lowest_utility():
    memory = TipMemory(dim=16, capacity_per_namespace=3, eviction="utility")
    vecs = unit(np.random.default_rng(0), 4)
    meta = {"task": "t", "variation": 0}
    a, b, c = memory.add(["a", "b", "c"], vecs[:3], [{**meta, "episode_return": r} for r in (50, 10, 30)])
    memory.update_utility([b, b, a], 90.0)  # b: mean 90 once (counted once per episode); a: 90
    memory.update_utility([a], 0.0)  # a: mean 45 -> now c (unused, own return 30) is lowest
    assert memory.get(a).utility == 45.0 and memory.get(b).utility_count == 1
    memory.add(["d"], vecs[3:], [{**meta, "episode_return": 0.0}])
    assert sorted(r.text for r in memory.records()) == ["a", "b", "d"]


def test_exact_duplicates_are_skipped_per_namespace():
    memory, vecs, _ = filled(3)
    meta = {"task": "t", "variation": 0}
    assert memory.add(["tip 1", "fresh", "fresh"], vecs, [meta] * 3) == [3]
    assert memory.add(["tip 1"], vecs[:1], [{"task": "t", "variation": 9}]) == [4]
    assert len(memory) == 5


def test_remove_and_readd():
    memory, vecs, ids = filled(4)
    memory.remove([ids[0]])
    hits = memory.search(vecs[:1], "t/0", min_sim=-1.0)[0]
    assert ids[0] not in {h[0].id for h in hits} and len(hits) == 3
    with pytest.raises(KeyError, match="999"):
        memory.remove([ids[1], 999])
    assert len(memory) == 3  # nothing removed by the failed call
    assert memory.add(["tip 0"], vecs[:1], [{"task": "t", "variation": 0}]) == [4]
    assert memory.search(vecs[:1], "t/0", k=1)[0][0][0].id == 4


def test_index_grows_and_reuses_deleted_slots():
    rng = np.random.default_rng(0)
    memory = TipMemory(dim=16, namespace="global", capacity_per_namespace=150)
    vecs = unit(rng, 500)
    for start in range(0, 500, 50):
        memory.add([f"x{i}" for i in range(start, start + 50)], vecs[start:start + 50], [{"task": "a"}] * 50)
    assert len(memory) == 150 and memory.index_slots("*") == 150
    live = np.array([r.id for r in memory.records()])
    exact = live[np.argsort(-(vecs[:5] @ vecs[live].T), axis=1)[:, :10]]
    found = memory.search(vecs[:5], "*", min_sim=-1.0)
    assert [[h[0].id for h in f] for f in found] == exact.tolist()


def test_search_stays_exact_when_deletions_disconnect_the_graph():
    # M=2 with churn leaves live nodes hnswlib cannot reach; asking for every tip must still work.
    rng = np.random.default_rng(1)
    memory = TipMemory(dim=16, namespace="global", capacity_per_namespace=300, M=2, ef_construction=10,
                       ef_search=10)
    for it in range(30):
        memory.add([f"x{it}-{j}" for j in range(40)], rng.standard_normal((40, 16)), [{"task": "a"}] * 40)
        if it % 2 == 1:
            memory.remove(rng.choice([r.id for r in memory.records()], 60, replace=False).tolist())
    q = unit(rng, 3)
    found = memory.search(q, "*", k=len(memory), min_sim=-1.0)
    assert all(len(f) == len(memory) for f in found)
    assert all(sorted(h[0].id for h in f) == sorted(r.id for r in memory.records()) for f in found)


def test_utility_weight_reorders_results():
    vecs = unit(np.random.default_rng(0), 1)
    close = vecs[0] + 0.01 * unit(np.random.default_rng(1), 1)[0]
    metas = [{"task": "t", "variation": 0, "episode_return": r} for r in (0.0, 0.0)]
    for weight, first in ((0.0, "near"), (0.1, "useful")):
        memory = TipMemory(dim=16, utility_weight=weight)
        near, useful = memory.add(["near", "useful"], np.stack([vecs[0], close]), metas)
        memory.update_utility([useful], 100.0)
        assert memory.search(vecs, "t/0")[0][0][0].text == first


def test_rank_by_score_keeps_tips_above_the_threshold_and_takes_the_best_episodes():
    """Released code: every tip with cosine above min_sim is a candidate; the top k by episode score win, even
    over more similar ones. The paper's ranking takes the most similar."""
    rng = np.random.default_rng(0)
    query = unit(rng, 1)
    near = [query[0] + 0.05 * v for v in unit(rng, 4)]  # cos ~ 0.99, returns 1..4
    far = unit(rng, 1)[0]  # below min_sim: never retrieved, whatever its score
    vecs = np.stack(near + [far])
    metas = [{"task": "t", "variation": 0, "episode_return": r} for r in (1.0, 2.0, 3.0, 4.0, 100.0)]
    texts = ["r1", "r2", "r3", "r4", "far"]
    by_score = TipMemory(dim=16, rank_by="score", top_k=2)
    by_score.add(texts, vecs, metas)
    assert [r.text for r, _ in by_score.search(query, "t/0")[0]] == ["r4", "r3"]
    by_sim = TipMemory(dim=16, top_k=2)
    by_sim.add(texts, vecs, metas)
    sims = vecs[:4] @ query[0] / np.linalg.norm(vecs[:4], axis=1)
    assert [r.text for r, _ in by_sim.search(query, "t/0")[0]] == [texts[i] for i in np.argsort(-sims)[:2]]
    with pytest.raises(ValueError, match="rank_by"):
        TipMemory(dim=16, rank_by="return")


def test_bad_input_gets_clear_errors():
    memory, vecs, _ = filled(2)
    with pytest.raises(ValueError, match=r"\(n, 16\), got \(1, 8\)"):
        memory.search(np.ones((1, 8)), "t/0")
    with pytest.raises(ValueError, match="one namespace key per query"):
        memory.search(vecs, ["t/0"])
    with pytest.raises(ValueError, match="zero vector"):
        memory.add(["z"], np.zeros((1, 16)), [{"task": "t", "variation": 0}])
    with pytest.raises(ValueError, match="sanitize_tip"):
        memory.add(["a</tip><tip>b"], vecs[:1], [{"task": "t", "variation": 0}])
    with pytest.raises(ValueError, match="2 texts, 1 vectors"):
        memory.add(["a", "b"], vecs[:1], [{"task": "t", "variation": 0}] * 2)


# ----------------------------------------------------------------------------- persistence


def test_state_dict_round_trip_without_pickle(tmp_path):
    memory, vecs, _ = filled(8)
    memory.update_utility([1, 2], 60.0)
    state = memory.state_dict()
    arrays = {"embeddings": state.pop("embeddings"), **{f"idx:{k}": v for k, v in state.pop("indexes").items()}}
    json.dumps(state)  # the rest is plain JSON
    np.savez(tmp_path / "s.npz", **arrays)
    with np.load(tmp_path / "s.npz", allow_pickle=False) as npz:
        state["embeddings"] = npz["embeddings"]
        state["indexes"] = {k[4:]: npz[k] for k in npz.files if k.startswith("idx:")}
    other = TipMemory(dim=3)
    other.load_state_dict(state)
    assert other.records() == memory.records() and other.config() == memory.config()
    assert other.search(vecs, "t/0") == memory.search(vecs, "t/0")


def test_raw_tips_are_stored_and_restored_only_in_a_raw_memory():
    """raw_tips (memory.tip_format=raw, released code): several lines and tags are kept as written; a default
    memory refuses them, and restoring a raw memory's state keeps both the texts and the setting."""
    raw = ["Went to the kitchen.\nThen </tip> focus; At that timestep, ...", "one more"]
    vecs = unit(np.random.default_rng(0), 2, 16)
    metas = [{"task": "t", "variation": 0}] * 2
    with pytest.raises(ValueError, match="line break"):
        TipMemory(dim=16).add(raw, vecs, metas)
    memory = TipMemory(dim=16, raw_tips=True)
    assert len(memory.add(raw, vecs, metas)) == 2
    with pytest.raises(ValueError, match="non-empty"):
        memory.add([""], vecs[:1], metas[:1])
    other = TipMemory(dim=3)
    other.load_state_dict(memory.state_dict())
    assert other.raw_tips and [r.text for r in other.records()] == raw
    with pytest.raises(ValueError, match="line break"):  # a line memory's state cannot smuggle raw text in
        state = memory.state_dict()
        state["config"] = dict(state["config"], raw_tips=False)
        TipMemory(dim=16).load_state_dict(state)


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_missing_or_truncated_index_is_rebuilt(tmp_path, damage):
    memory, vecs, _ = filled(20)
    memory.save(tmp_path / "mem")
    (index_file,) = (tmp_path / "mem" / "index").iterdir()
    if damage == "delete":
        index_file.unlink()
    else:
        index_file.write_bytes(index_file.read_bytes()[:100])
    with pytest.warns(RuntimeWarning, match="rebuilding"):
        loaded = TipMemory.load(tmp_path / "mem")
    expected = [[(r.id, round(s, 5)) for r, s in q] for q in memory.search(vecs, "t/0", min_sim=-1.0)]
    assert [[(r.id, round(s, 5)) for r, s in q] for q in loaded.search(vecs, "t/0", min_sim=-1.0)] == expected


def test_intact_index_loads_without_warning(tmp_path):
    memory, _, _ = filled(5)
    memory.save(tmp_path / "mem")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TipMemory.load(tmp_path / "mem")


def test_corrupt_records_name_the_file(tmp_path):
    memory, _, _ = filled(3)
    memory.save(tmp_path / "mem")
    records = tmp_path / "mem" / "records.json"
    records.write_text(records.read_text()[:50])
    with pytest.raises(ValueError, match="records.json"):
        TipMemory.load(tmp_path / "mem")
    memory.save(tmp_path / "mem")  # saving over a directory replaces it whole
    data = json.loads(records.read_text())
    del data["records"][0]["text"]
    records.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"records.json: record 0: missing fields \['text'\]"):
        TipMemory.load(tmp_path / "mem")


def test_embeddings_not_matching_records_is_an_error(tmp_path):
    memory, _, _ = filled(3)
    memory.save(tmp_path / "mem")
    np.save(tmp_path / "mem" / "embeddings.npy", np.zeros((2, 16), np.float32))
    with pytest.raises(ValueError, match=r"shape \(2, 16\), expected \(3, 16\)"):
        TipMemory.load(tmp_path / "mem")


# ----------------------------------------------------------------------------- merge


def test_merge_is_independent_of_arrival_order():
    rng = np.random.default_rng(0)
    vecs = unit(rng, 30)
    texts = [f"tip {i % 25}" for i in range(30)]  # some duplicates
    metas = [{"task": "t", "variation": i % 2, "iteration": i % 3, "source_rank": i % 4,
              "episode_return": float(i)} for i in range(30)]
    order = rng.permutation(30)
    a = TipMemory(dim=16, capacity_per_namespace=8)
    b = TipMemory(dim=16, capacity_per_namespace=8)
    a.merge(texts, vecs, metas)
    b.merge([texts[i] for i in order], vecs[order], [metas[i] for i in order])
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["records"] == sb["records"] and len(sa["records"]) == 16
    np.testing.assert_array_equal(sa["embeddings"], sb["embeddings"])
    assert sa["indexes"].keys() == sb["indexes"].keys()
    for key in sa["indexes"]:
        np.testing.assert_array_equal(sa["indexes"][key], sb["indexes"][key])


def test_export_then_merge_copies_tips():
    memory, vecs, _ = filled(5)
    copy = TipMemory(dim=16)
    copy.merge(*memory.export())
    assert [r.text for r in copy.records()] == [r.text for r in memory.records()]
    assert copy.search(vecs, "t/0") == memory.search(vecs, "t/0")


def _kept_of_duplicates(first: dict, second: dict) -> dict:
    """Merges one text twice under two metas, in both arrival orders (same vector, so only the metas decide);
    both orders must keep the same one, whose meta is returned."""
    vecs = unit(np.random.default_rng(3), 1).repeat(2, axis=0)
    kept = []
    for metas in ([first, second], [second, first]):
        memory = TipMemory(dim=16, namespace="task")
        memory.merge(["the same tip", "the same tip"], vecs, metas)
        (record,) = memory.records()
        kept.append(record.meta())
    assert kept[0] == kept[1], kept
    return kept[0]


@pytest.mark.parametrize("field, first, second", [
    ("step", None, 0),  # an episode's entry (no step) before its steps'
    ("step", 1, 2),
    ("variation", 1, 2),
    ("action", None, "A"),  # no action sorts as "", before any action
    ("action", "a", "b"),
])
def test_merge_keeps_the_duplicate_that_sorts_first(field, first, second):
    base = {"task": "t", "variation": 0, "episode_return": 1.0}
    kept = _kept_of_duplicates({**base, field: first}, {**base, field: second})
    assert kept[field] == first


def test_merge_orders_by_namespace_before_text():
    vecs = unit(np.random.default_rng(4), 2)
    metas = [{"task": "a", "variation": 0}, {"task": "b", "variation": 0}]
    for order in ([0, 1], [1, 0]):
        memory = TipMemory(dim=16, namespace="task")
        memory.merge([["z tip", "a tip"][i] for i in order], vecs[order], [metas[i] for i in order])
        assert [(r.id, r.task) for r in memory.records()] == [(0, "a"), (1, "b")]


def test_merge_and_export_errors_and_edges_by_hand():
    memory = TipMemory(dim=16, namespace="task")
    assert memory.size("nowhere") == 0 and memory.index_slots("nowhere") == 0
    with pytest.raises(ValueError, match=r"^merge needs one vector and one meta per text: got 1 texts, 2 vectors, "
                                         r"1 metas$"):
        memory.merge(["a"], unit(np.random.default_rng(5), 2), [{"task": "t"}])
    with pytest.raises(ValueError, match=r"^vectors contain a zero vector"):
        memory.merge(["a"], np.zeros((1, 16)), [{"task": "t"}])
    with pytest.raises(TypeError, match=r"^metas\[1\]\['task'\] must be str"):
        memory.merge(["a", "b"], unit(np.random.default_rng(6), 2), [{"task": "t"}, {"task": 3}])
    ids = memory.add(["a", "b"], unit(np.random.default_rng(7), 2), [{"task": "t"}, {"task": "t"}])
    texts, vecs, metas = memory.export([ids[1]])
    assert texts == ["b"] and vecs.shape == (1, 16) and vecs.dtype == np.float32 and metas[0]["task"] == "t"


def test_rank_by_score_breaks_a_tie_in_return_by_similarity():
    e = np.eye(16, dtype=np.float32)
    query = e[:1]
    vecs = np.stack([e[0] + e[1], e[0] + 0.1 * e[1]])  # cosines 0.71 and 0.995 to the query, the same return
    memory = TipMemory(dim=16, rank_by="score", top_k=2, min_sim=0.0)
    memory.add(["less similar", "more similar"], vecs, [{"task": "t", "variation": 0, "episode_return": 5.0}] * 2)
    assert [r.text for r, _ in memory.search(query, "t/0")[0]] == ["more similar", "less similar"]


def test_a_batch_dedups_within_a_namespace_only_and_names_a_bad_meta_by_position():
    memory = TipMemory(dim=16, namespace="task")
    ids = memory.add(["same tip", "same tip"], unit(np.random.default_rng(8), 2), [{"task": "a"}, {"task": "b"}])
    assert len(ids) == 2 and sorted(r.task for r in memory.records()) == ["a", "b"]
    with pytest.raises(TypeError, match=r"^metas\[1\]\['task'\] must be str"):
        memory.add(["x", "y"], unit(np.random.default_rng(9), 2), [{"task": "a"}, {"task": 3}])
