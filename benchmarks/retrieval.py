"""Tip retrieval speed and quality: TipMemory (hnswlib) against exact numpy search.

For each memory size: build time, index memory, recall@10 against exact search, and per-query
latency (median, p99) of TipMemory.search, of the bare hnswlib query under it, and of exact
numpy search (one query at a time, as a rollout step asks). Prints a table and writes JSON
(benchmarks/results/ unless a path is given).

    python benchmarks/retrieval.py                       # 10k and 100k
    python benchmarks/retrieval.py --sizes 10000 --data iid
    python benchmarks/retrieval.py --with-1m out.json    # adds 1M (several GB, minutes to build)

Vectors: "latent" (default) are random unit vectors of low intrinsic dimension, like sentence
embeddings; "iid" are i.i.d. Gaussian, which have no neighbourhood structure in 384 dimensions and
show the worst case for any graph index.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import time
from pathlib import Path

import numpy as np

from empo2.memory import TipMemory

DIM = 384  # all-MiniLM-L6-v2


def make_vectors(rng: np.random.Generator, n: int, kind: str, latent: int = 16) -> np.ndarray:
    if kind == "iid":
        v = rng.standard_normal((n, DIM))
    else:
        basis = np.random.default_rng(1234).standard_normal((latent, DIM))
        v = rng.standard_normal((n, latent)) @ basis + 0.05 * rng.standard_normal((n, DIM))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


def rss_mib() -> float:
    """Current resident memory (Linux /proc), MiB."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def latencies_ms(fn, queries: np.ndarray) -> np.ndarray:
    out = np.empty(len(queries))
    for i in range(len(queries)):
        start = time.perf_counter()
        fn(queries[i:i + 1])
        out[i] = (time.perf_counter() - start) * 1e3
    return out


def exact_topk(data: np.ndarray, query: np.ndarray, k: int) -> np.ndarray:
    sims = query @ data.T
    top = np.argpartition(-sims, k, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(sims, top, axis=1), axis=1)
    return np.take_along_axis(top, order, axis=1)


def bench(n: int, n_queries: int, kind: str, k: int, ef_search: int, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    data, queries = make_vectors(rng, n, kind), make_vectors(rng, n_queries, kind)
    rss_before = rss_mib()
    memory = TipMemory(dim=DIM, namespace="global", capacity_per_namespace=n, ef_search=ef_search)
    start = time.perf_counter()
    chunk = 10_000
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        memory.add([f"tip {i}" for i in range(lo, hi)], data[lo:hi], [{"task": "bench"}] * (hi - lo))
    build_s = time.perf_counter() - start
    rss_after = rss_mib()
    # The namespace index itself, to time the bare hnswlib query apart from TipMemory's bookkeeping.
    index = memory._indexes["*"]
    index_mib = index.to_bytes().nbytes / 2**20

    def search(q: np.ndarray) -> list:
        return memory.search(q, "*", k=k, min_sim=-1.0)

    mem_ms = latencies_ms(search, queries)
    raw_ms = latencies_ms(lambda q: index.query(q, k), queries)
    exact_ms = latencies_ms(lambda q: exact_topk(data, q, k), queries)
    exact = exact_topk(data, queries, k)
    found = search(queries)
    recall = float(np.mean([len({h[0].id for h in f} & set(e.tolist())) / k for f, e in zip(found, exact)]))
    return {
        "n": n, "data": kind, "ef_search": ef_search, "build_s": build_s, "recall_at_10": recall,
        "index_mib": index_mib, "rss_growth_mib": rss_after - rss_before,
        "search_median_ms": float(np.median(mem_ms)), "search_p99_ms": float(np.percentile(mem_ms, 99)),
        "hnsw_median_ms": float(np.median(raw_ms)), "hnsw_p99_ms": float(np.percentile(raw_ms, 99)),
        "exact_median_ms": float(np.median(exact_ms)), "exact_p99_ms": float(np.percentile(exact_ms, 99)),
        "speedup_median": float(np.median(exact_ms) / np.median(mem_ms)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, default=Path(__file__).parent / "results" / "retrieval.json")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--with-1m", action="store_true", help="also measure 1,000,000 tips")
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("--data", choices=["latent", "iid"], default="latent")
    parser.add_argument("--ef-search", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = args.sizes + ([1_000_000] if args.with_1m else [])
    rows = []
    header = (f"{'n':>9} {'build s':>8} {'index MiB':>9} {'RSS +MiB':>8} {'recall@10':>9} {'search med/p99 ms':>18} "
              f"{'hnsw med ms':>11} {'exact med/p99 ms':>17} {'speedup':>8}")
    print(header)
    for n in sizes:
        r = bench(n, args.queries, args.data, 10, args.ef_search, args.seed)
        rows.append(r)
        print(f"{n:>9} {r['build_s']:>8.1f} {r['index_mib']:>9.1f} {r['rss_growth_mib']:>8.1f} "
              f"{r['recall_at_10']:>9.3f} "
              f"{r['search_median_ms']:>8.3f}/{r['search_p99_ms']:<9.3f} {r['hnsw_median_ms']:>11.3f} "
              f"{r['exact_median_ms']:>8.3f}/{r['exact_p99_ms']:<8.3f} {r['speedup_median']:>7.1f}x", flush=True)
    report = {"machine": platform.platform(), "processor": platform.processor(), "dim": DIM,
              "queries": args.queries, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
