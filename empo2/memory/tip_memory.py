"""TipMemory: tips, their metadata and embeddings in per-namespace hnswlib indexes.

Why one index per namespace rather than one global index with a `filter` callable: the filter is
a Python callback run for every node hnswlib visits (slow, holds the GIL), and a selective filter
(one task variation among hundreds) starves the graph walk so recall drops. Namespaces are also
the unit of capacity and eviction. Separate indexes give exact isolation and keep each search
as fast as an unfiltered query on that namespace's tips.
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from .index import NamespaceIndex
from .persistence import (
    atomic_directory,
    read_json,
    read_npy,
    sha256_bytes,
    sha256_file,
    write_json,
    write_npy,
)
from .records import NAMESPACE_MODES, TipRecord, namespace_key, parse_meta
from .tips import check_tip_line

FORMAT = "empo2.tip_memory/1"
RECORDS_FILE = "records.json"
EMBEDDINGS_FILE = "embeddings.npy"
EVICTION_POLICIES = ("oldest", "utility")
RANKINGS = ("similarity", "score")
# With utility blending, this many times k candidates are re-ranked so a useful tip slightly
# below the k-th similarity can still move up.
_RERANK_FACTOR = 4

_CONFIG_KEYS = ("dim", "namespace", "capacity_per_namespace", "eviction", "min_sim", "top_k",
                "utility_weight", "rank_by", "M", "ef_construction", "ef_search", "seed", "raw_tips")

Hit = tuple[TipRecord, float]


class TipMemory:
    """Tips keyed by embedding, searched by cosine similarity within a namespace.

    namespace: "variation" (one slot per task variation, as the released code), "task" or "global".
    capacity_per_namespace: live tips per namespace; adding to a full one evicts first, by
        `eviction` "oldest" (insertion order) or "utility" (lowest `TipRecord.utility`, oldest on ties).
    min_sim, top_k: search defaults (keep tips with cosine >= min_sim, at most top_k per query).
    utility_weight: search ranks by `sim + utility_weight * utility` (0 = similarity only).
    rank_by: "similarity" (the paper: the most similar tips above min_sim) or "score" (the released
        code: every tip above min_sim is a candidate and the top_k with the best episode return win).
    M, ef_construction, ef_search, seed: hnswlib parameters; ef_search is the query-time beam.
    raw_tips: accept any non-empty text (the released code's raw tips, several lines possibly), for prompts that
        cut tips by token position (`rollout.prompt_template=released`); False (default) accepts only sanitised
        one-line tips, which the one-line `<tip>` format relies on.
    """

    def __init__(self, dim: int, namespace: str = "variation", capacity_per_namespace: int = 1000,
                 eviction: str = "oldest", min_sim: float = 0.5, top_k: int = 10,
                 utility_weight: float = 0.0, rank_by: str = "similarity", M: int = 16,
                 ef_construction: int = 200, ef_search: int = 64, seed: int = 0, raw_tips: bool = False) -> None:
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if namespace not in NAMESPACE_MODES:
            raise ValueError(f"namespace must be one of {NAMESPACE_MODES}, got {namespace!r}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        if rank_by not in RANKINGS:
            raise ValueError(f"rank_by must be one of {RANKINGS}, got {rank_by!r}")
        if capacity_per_namespace < 1 or top_k < 1 or M < 2 or ef_construction < 1 or ef_search < 1:
            raise ValueError("capacity_per_namespace, top_k, ef_construction, ef_search must be >= 1 and M >= 2")
        if not -1.0 <= min_sim <= 1.0:
            raise ValueError(f"min_sim is a cosine similarity in [-1, 1], got {min_sim}")
        self.dim = int(dim)
        self.namespace = namespace
        self.capacity_per_namespace = int(capacity_per_namespace)
        self.eviction = eviction
        self.min_sim = float(min_sim)
        self.top_k = int(top_k)
        self.utility_weight = float(utility_weight)
        self.rank_by = rank_by
        self.M = int(M)
        self.ef_construction = int(ef_construction)
        self.ef_search = int(ef_search)
        self.seed = int(seed)
        self.raw_tips = bool(raw_tips)
        self._records: dict[int, TipRecord] = {}
        self._indexes: dict[str, NamespaceIndex] = {}
        # namespace -> text -> id, for duplicate checks.
        self._texts: dict[str, dict[str, int]] = {}
        self._next_id = 0

    def _check_text(self, text: str) -> None:
        """A stored text must be a sanitised line (`check_tip_line`), or with `raw_tips` any non-empty string."""
        if not self.raw_tips:
            check_tip_line(text)
        elif not isinstance(text, str) or not text:
            raise ValueError(f"a raw tip must be a non-empty str, got {text!r}")

    def config(self) -> dict[str, object]:
        """Constructor arguments, enough to build an empty memory with the same behaviour."""
        return {key: getattr(self, key) for key in _CONFIG_KEYS}

    def namespace_key(self, task: str | None, variation: int | str | None = None) -> str:
        return namespace_key(self.namespace, task, variation)

    def __len__(self) -> int:
        return len(self._records)

    def size(self, namespace_key: str) -> int:
        index = self._indexes.get(namespace_key)
        return 0 if index is None else len(index)

    def index_slots(self, namespace_key: str) -> int:
        """Allocated index slots of a namespace: live tips plus deleted ones awaiting reuse."""
        index = self._indexes.get(namespace_key)
        return 0 if index is None else index.slots

    def namespaces(self) -> list[str]:
        return [key for key, index in self._indexes.items() if len(index)]

    def get(self, tip_id: int) -> TipRecord:
        return self._records[tip_id]

    def records(self) -> list[TipRecord]:
        """All live records, oldest (lowest id) first."""
        return sorted(self._records.values(), key=lambda r: r.id)

    # ----------------------------------------------------------------------------- writing

    def add(self, texts: Sequence[str], vectors: np.ndarray, metas: Sequence[Mapping[str, object]]) -> list[int]:
        """Stores tips; returns the ids of those actually added, in input order.

        texts: n sanitised one-line entries. vectors: (n, dim) keys (any norm but zero).
        metas: n dicts with keys of `records.META_DEFAULTS` (task, variation, episode_return, ...).
        A text already stored in its namespace, or repeated in the batch, is skipped. A full
        namespace evicts before inserting; a batch larger than a namespace's capacity keeps its
        last `capacity_per_namespace` entries for it.
        """
        texts = list(texts)
        metas = list(metas)
        vecs = self._check_vectors(vectors, "vectors")
        if not len(texts) == len(vecs) == len(metas):
            raise ValueError(f"add needs one vector and one meta per text: got {len(texts)} texts, "
                             f"{len(vecs)} vectors, {len(metas)} metas")
        by_namespace: dict[str, list[tuple[int, dict[str, object]]]] = {}
        batch_texts: dict[str, set[str]] = {}
        for i, (text, meta) in enumerate(zip(texts, metas)):
            self._check_text(text)
            parsed = parse_meta(meta, i)
            key = self.namespace_key(parsed["task"], parsed["variation"])  # type: ignore[arg-type]
            seen = batch_texts.setdefault(key, set())
            if text in seen or text in self._texts.get(key, {}):
                continue
            seen.add(text)
            by_namespace.setdefault(key, []).append((i, {**parsed, "namespace": key}))
        kept = sorted(item for items in by_namespace.values() for item in items[-self.capacity_per_namespace:])
        ids = {i: self._next_id + n for n, (i, _) in enumerate(kept)}
        self._next_id += len(kept)
        for i, parsed in kept:
            record = TipRecord(id=ids[i], text=texts[i], **parsed)  # type: ignore[arg-type]
            self._records[record.id] = record
            self._texts.setdefault(record.namespace, {})[record.text] = record.id
        for key, items in by_namespace.items():
            items = items[-self.capacity_per_namespace:]
            if key not in self._indexes:
                self._indexes[key] = NamespaceIndex.create(
                    self.dim, self.capacity_per_namespace, self.M, self.ef_construction, self.ef_search,
                    self.seed)
            index = self._indexes[key]
            # Only tips already in the index are candidates: new tips always get in.
            self._evict(key, len(index) + len(items) - self.capacity_per_namespace)
            index.add([ids[i] for i, _ in items], vecs[[i for i, _ in items]])
        return [ids[i] for i, _ in kept]

    def merge(self, texts: Sequence[str], vectors: np.ndarray, metas: Sequence[Mapping[str, object]]) -> list[int]:
        """`add` in a canonical order, so the result does not depend on the order tips arrive in.

        Ranks that each merge the same gathered tips (and start identical) end with identical
        memories: same ids, same eviction, same index graph. Tips are sorted by (iteration,
        source_rank, namespace, text, step, ...), the vector bytes breaking any remaining tie.
        """
        texts = list(texts)
        metas = list(metas)
        vecs = self._check_vectors(vectors, "vectors")
        if not len(texts) == len(vecs) == len(metas):
            raise ValueError(f"merge needs one vector and one meta per text: got {len(texts)} texts, "
                             f"{len(vecs)} vectors, {len(metas)} metas")

        def sort_key(i: int) -> tuple:
            m = parse_meta(metas[i], i)
            key = self.namespace_key(m["task"], m["variation"])  # type: ignore[arg-type]
            return (m["iteration"], m["source_rank"], key, texts[i], -1 if m["step"] is None else m["step"],
                    m["episode_return"], str(m["variation"]), m["action"] or "", vecs[i].tobytes())

        order = sorted(range(len(texts)), key=sort_key)
        return self.add([texts[i] for i in order], vecs[order], [metas[i] for i in order])

    def export(self, ids: Sequence[int] | None = None) -> tuple[list[str], np.ndarray, list[dict[str, object]]]:
        """(texts, vectors (n, dim), metas) of `ids` (all tips when None), ready for `add`/`merge`."""
        records = self.records() if ids is None else [self._records[i] for i in ids]
        return ([r.text for r in records], self._vectors_of(records), [r.meta() for r in records])

    def remove(self, ids: Sequence[int]) -> None:
        """Deletes tips by id. Unknown ids raise KeyError before anything is removed."""
        ids = list(dict.fromkeys(ids))
        unknown = [i for i in ids if i not in self._records]
        if unknown:
            raise KeyError(f"no tips with ids {unknown}")
        for tip_id in ids:
            self._drop(tip_id)

    def update_utility(self, tip_ids: Sequence[int], episode_return: float) -> None:
        """Adds one episode's return to the running mean of each tip its prompts carried.

        A tip retrieved at several steps of the episode counts once. Ids no longer stored (evicted
        while the episode ran) are ignored.
        """
        for tip_id in dict.fromkeys(tip_ids):
            record = self._records.get(tip_id)
            if record is not None:
                self._records[tip_id] = replace(record, utility_sum=record.utility_sum + float(episode_return),
                                                utility_count=record.utility_count + 1)

    def _evict(self, key: str, count: int) -> None:
        if count <= 0:
            return
        ids = self._indexes[key].ids
        if self.eviction == "oldest":
            victims = list(ids)[:count]
        else:
            victims = heapq.nsmallest(count, ids, key=lambda i: (self._records[i].utility, i))
        for tip_id in victims:
            self._drop(tip_id)

    def _drop(self, tip_id: int) -> None:
        record = self._records.pop(tip_id)
        del self._texts[record.namespace][record.text]
        self._indexes[record.namespace].remove([tip_id])

    # ----------------------------------------------------------------------------- searching

    def search(self, query_vectors: np.ndarray, namespace_keys: Sequence[str] | str, k: int | None = None,
               min_sim: float | None = None) -> list[list[Hit]]:
        """The best tips for each of n queries: n lists of (record, cosine similarity), best first.

        query_vectors: (n, dim). namespace_keys: one key per query (or one key for all), from
        `namespace_key(task, variation)`; an unknown namespace gives no tips. Tips below `min_sim`
        are dropped; at most `k` remain. With `utility_weight` the order is by
        `sim + utility_weight * utility`, ties by id. With `rank_by="score"` every tip of the
        namespace above `min_sim` competes and the order is by episode return (then similarity, id).
        """
        q = self._check_vectors(query_vectors, "query_vectors")
        keys = [namespace_keys] * len(q) if isinstance(namespace_keys, str) else list(namespace_keys)
        if len(keys) != len(q):
            raise ValueError(f"need one namespace key per query: {len(q)} queries, {len(keys)} keys")
        k = self.top_k if k is None else int(k)
        min_sim = self.min_sim if min_sim is None else float(min_sim)
        fetch = k if self.utility_weight == 0 else _RERANK_FACTOR * k
        by_score = self.rank_by == "score"
        rows_by_key: dict[str, list[int]] = {}
        for row, key in enumerate(keys):
            rows_by_key.setdefault(key, []).append(row)
        results: list[list[Hit]] = [[] for _ in keys]
        for key, rows in rows_by_key.items():
            index = self._indexes.get(key)
            if index is None or k < 1:
                continue
            # ranking by score needs every tip above the threshold, not only the k most similar
            labels, sims = index.query(q[rows], self.size(key) if by_score else fetch)
            for row, row_labels, row_sims in zip(rows, labels, sims):
                hits = [(self._records[int(i)], float(s)) for i, s in zip(row_labels, row_sims) if s >= min_sim]
                if by_score:
                    hits.sort(key=lambda h: (-h[0].episode_return, -h[1], h[0].id))
                else:
                    hits.sort(key=lambda h: (-(h[1] + self.utility_weight * h[0].utility), h[0].id))
                results[row] = hits[:k]
        return results

    # ----------------------------------------------------------------------------- persistence

    def state_dict(self) -> dict[str, object]:
        """JSON-able header plus numpy arrays (no pickle): "embeddings" (n, dim) float32 in record
        order and "indexes" {namespace: uint8 bytes of the hnswlib index file}."""
        header = self._header()
        header["embeddings"] = self._vectors_of(self.records())
        header["indexes"] = {key: index.to_bytes() for key, index in self._indexes.items() if len(index)}
        header["index_sha256"] = {key: sha256_bytes(blob) for key, blob in header["indexes"].items()}
        return header

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Replaces this memory's contents and settings with `state` (from `state_dict`)."""
        blobs = state.get("indexes", {})
        sums = state.get("index_sha256", {})
        # Built aside and swapped in, so a bad state dict leaves this memory unchanged.
        fresh = type(self)(**_config_from(state, "state dict"))

        def load_index(key: str, ids: list[int]) -> NamespaceIndex | None:
            blob = blobs.get(key)  # type: ignore[union-attr]
            if blob is None or sha256_bytes(np.asarray(blob)) != sums.get(key):  # type: ignore[union-attr]
                return None
            return NamespaceIndex.from_bytes(np.asarray(blob, dtype=np.uint8), fresh.dim,
                                             fresh.capacity_per_namespace, fresh.ef_search, ids)

        fresh._restore(state, np.asarray(state.get("embeddings")), "state dict", load_index)
        self.__dict__ = fresh.__dict__

    def save(self, path: str | Path) -> None:
        """Writes the memory to directory `path` atomically: records.json (settings and records),
        embeddings.npy (n, dim) and one hnswlib file per namespace under index/."""
        header = self._header()
        header["indexes"] = []
        with atomic_directory(path) as tmp:
            (tmp / "index").mkdir()
            for n, (key, index) in enumerate(self._indexes.items()):
                if not len(index):
                    continue
                name = f"index/ns-{n:05d}.bin"
                index.save(tmp / name)
                header["indexes"].append({"namespace": key, "file": name, "sha256": sha256_file(tmp / name)})
            write_npy(tmp / EMBEDDINGS_FILE, self._vectors_of(self.records()))
            write_json(tmp / RECORDS_FILE, header)

    @classmethod
    def load(cls, path: str | Path) -> TipMemory:
        """Reads a directory written by `save`. A missing, corrupt or mismatched index file is
        rebuilt from embeddings.npy with a warning; corrupt records raise ValueError naming the file."""
        path = Path(path)
        records_file = path / RECORDS_FILE
        header = read_json(records_file)
        embeddings = read_npy(path / EMBEDDINGS_FILE)
        entries = header.get("indexes")
        if not isinstance(entries, list):
            raise ValueError(f"corrupt tip memory records file {records_file}: 'indexes' is not a list")
        files = {e["namespace"]: e for e in entries if isinstance(e, dict) and "namespace" in e}
        memory = cls(**_config_from(header, str(records_file)))

        def load_index(key: str, ids: list[int]) -> NamespaceIndex | None:
            entry = files.get(key)
            if entry is None:
                return None
            file = path / str(entry.get("file"))
            if not file.is_file() or sha256_file(file) != entry.get("sha256"):
                return None
            return NamespaceIndex.from_file(file, memory.dim, memory.capacity_per_namespace,
                                            memory.ef_search, ids)

        memory._restore(header, embeddings, str(records_file), load_index)
        return memory

    def _header(self) -> dict[str, object]:
        return {"format": FORMAT, "config": self.config(), "next_id": self._next_id,
                "records": [r.to_json() for r in self.records()]}

    def _restore(self, header: Mapping[str, object], embeddings: np.ndarray, where: str,
                 load_index: Callable[[str, list[int]], NamespaceIndex | None]) -> None:
        """Fills this freshly constructed memory from a header, embeddings (n, dim) and a loader
        of saved indexes.

        The loader returns None when a namespace's saved index is missing or fails its checksum;
        that index is then rebuilt from the embeddings (same tips, possibly a different graph).
        """
        raw = header.get("records")
        if not isinstance(raw, list):
            raise ValueError(f"corrupt tip memory records in {where}: 'records' is not a list")
        records = [TipRecord.from_json(r, f"{where}: record {n}") for n, r in enumerate(raw)]
        for n, record in enumerate(records):  # an edited file must not smuggle a line or tag into a prompt
            try:
                self._check_text(record.text)
            except (TypeError, ValueError) as err:
                raise ValueError(f"corrupt tip memory records in {where}: record {n}: {err}") from None
        if embeddings.ndim != 2 or embeddings.shape != (len(records), self.dim):
            raise ValueError(f"tip memory embeddings in {where} have shape {embeddings.shape}, "
                             f"expected ({len(records)}, {self.dim}) for the stored records")
        rows_by_key: dict[str, list[int]] = {}
        for row, record in enumerate(records):
            self._records[record.id] = record
            self._texts.setdefault(record.namespace, {})[record.text] = record.id
            rows_by_key.setdefault(record.namespace, []).append(row)
        if len(self._records) != len(records):
            raise ValueError(f"corrupt tip memory records in {where}: duplicate record ids")
        next_id = header.get("next_id")
        if not isinstance(next_id, int) or (records and next_id <= max(self._records)):
            raise ValueError(f"corrupt tip memory records in {where}: bad next_id {next_id!r}")
        self._next_id = next_id
        for key, rows in rows_by_key.items():
            ids = [records[r].id for r in rows]
            try:
                index = load_index(key, ids)
            except RuntimeError:
                index = None
            if index is None or not set(ids) <= index.labels():
                warnings.warn(f"tip memory index for namespace {key!r} in {where} is missing or corrupt; "
                              f"rebuilding it from the stored embeddings", RuntimeWarning, stacklevel=3)
                index = NamespaceIndex.create(self.dim, self.capacity_per_namespace, self.M,
                                              self.ef_construction, self.ef_search, self.seed)
                index.add(ids, embeddings[rows].astype(np.float32))
            self._indexes[key] = index

    def _vectors_of(self, records: Sequence[TipRecord]) -> np.ndarray:
        out = np.zeros((len(records), self.dim), dtype=np.float32)
        rows_by_key: dict[str, list[int]] = {}
        for row, record in enumerate(records):
            rows_by_key.setdefault(record.namespace, []).append(row)
        for key, rows in rows_by_key.items():
            out[rows] = self._indexes[key].vectors([records[r].id for r in rows])
        return out

    def _check_vectors(self, vectors: np.ndarray, name: str) -> np.ndarray:
        vecs = np.asarray(vectors, dtype=np.float32)
        if vecs.ndim != 2 or vecs.shape[1] != self.dim:
            raise ValueError(f"{name} must have shape (n, {self.dim}), got {vecs.shape}")
        if not np.isfinite(vecs).all():
            raise ValueError(f"{name} contain NaN or inf")
        if len(vecs) and (np.linalg.norm(vecs, axis=1) == 0).any():
            raise ValueError(f"{name} contain a zero vector; cosine similarity is undefined for it")
        return vecs


def _config_from(header: Mapping[str, object], where: str) -> dict[str, object]:
    if header.get("format") != FORMAT:
        raise ValueError(f"{where} is not a tip memory ({FORMAT}): format {header.get('format')!r}")
    config = header.get("config")
    if not isinstance(config, dict):
        raise ValueError(f"corrupt tip memory records in {where}: 'config' is not an object")
    unknown = config.keys() - set(_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"corrupt tip memory records in {where}: unknown settings {sorted(unknown)}")
    return config
