"""Mutation testing of the algorithm math, the tips, the tip memory and the prompt builder, against their fast
tests, with mutmut (pyproject.toml's `mutation` extra; installed into the running environment when another
version or none is there).
Not part of `make test`: it runs each module's tests once per mutant, which takes long on a small machine.

    python benchmarks/mutation.py                     # run, or continue the last run, then print the scores
    python benchmarks/mutation.py --report-only       # the scores and survivors of the last run
    python benchmarks/mutation.py --max-children 4    # more mutants at a time, on a machine with cores to spare

What is mutated and which tests run for it is pyproject.toml's [tool.mutmut]; mutmut works in `mutants/` (a copy
of the package and the tests) and keeps each mutant's result there, so a second run re-tests only what changed.
A timeout (a mutant that makes a test loop past mutmut's CPU-time limit) counts as caught. Scores and every
survivor with its reason: docs/testing.md. Writes benchmarks/results/mutation.json unless given another --out.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["mutation"][0]
BIN = Path(sys.executable).parent
CAUGHT = ("killed", "timeout")
GOAL = {"empo2.algo.core_algos": 0.95}  # the others: 0.85
# Scored apart: of the tip memory, its construction and persistence (save/load, state dicts; their round trips
# are tests of their own) are not retrieval or lifecycle; of the prompt builder, its construction and chat-template
# detection are not tip spans or truncation. mutmut mutates them too; their counts are printed on their own line.
APART = {
    "empo2.memory.tip_memory": ("__init__", "config", "export", "state_dict", "load_state_dict", "save", "load",
                                "_header", "_restore", "_config_from"),
    "empo2.rollout.prompts": ("__init__", "_template_pieces", "_template_accepts_layout", "_check_content_encoding",
                              "_encode_uncached", "_merged"),
}


def ensure_mutmut() -> None:
    try:
        if importlib.metadata.version("mutmut") == MUTMUT.split("==")[1]:
            return
    except importlib.metadata.PackageNotFoundError:
        pass
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", MUTMUT], check=True)


def statuses() -> dict[str, str]:
    """{mutant name: status} of every mutant of the last run, as `mutmut results --all true` prints them."""
    out = subprocess.run([BIN / "mutmut", "results", "--all", "true"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return dict(m.groups() for m in re.finditer(r"^\s+(\S+__mutmut_\d+): (.+)$", out, re.M))


def module_of(mutant: str) -> str:
    """The module a mutant belongs to, with " (apart)" for the functions `APART` scores on their own."""
    # mutmut names a mutant <module>.x_<function>__mutmut_<n>, or <module>.xǁ<class>ǁ<method>__mutmut_<n>
    module, function = re.match(r"^(.*?)\.x(?:_|ǁ\w+ǁ)(\w+?)__mutmut_\d+$", mutant).groups()
    return f"{module} (apart)" if function in APART.get(module, ()) else module


def report(by_name: dict[str, str]) -> dict:
    by_module: dict[str, dict[str, str]] = defaultdict(dict)
    for name, status in by_name.items():
        by_module[module_of(name)][name] = status
    rows = {}
    for module, found in sorted(by_module.items()):
        counts = Counter(found.values())
        caught = sum(counts[s] for s in CAUGHT)
        rows[module] = {"mutants": len(found), "killed": counts["killed"], "timeout": counts["timeout"],
                        "survived": counts["survived"], "not checked": counts["not checked"],
                        "other": len(found) - caught - counts["survived"] - counts["not checked"],
                        "score": caught / len(found),
                        "goal": 0.0 if module.endswith("(apart)") else GOAL.get(module, 0.85),
                        "survivors": sorted(n for n, s in found.items() if s not in (*CAUGHT, "not checked"))}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report-only", action="store_true", help="print the last run's scores, run nothing")
    ap.add_argument("--max-children", type=int, default=1, help="mutants tested at a time")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mutation.json")
    args = ap.parse_args()
    ensure_mutmut()
    if not args.report_only:
        subprocess.run(["nice", "-n", "10", BIN / "mutmut", "run", "--max-children", str(args.max_children)],
                       cwd=ROOT, check=True)
    rows = report(statuses())
    print(f"{'module':32} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'other':>5} {'unrun':>5} "
          f"{'score':>6}  goal")
    for module, r in rows.items():
        print(f"{module:32} {r['mutants']:7d} {r['killed']:6d} {r['timeout']:7d} {r['survived']:8d} {r['other']:5d} "
              f"{r['not checked']:5d} {r['score']:6.1%}  {r['goal']:.0%}{'' if r['score'] >= r['goal'] else '  below'}")
    for module, r in rows.items():
        if r["survivors"]:
            print(f"\n{module}: " + ", ".join(n.split(".")[-1] for n in r["survivors"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"\nwrote {args.out}; `mutmut show NAME` prints a mutant's diff")


if __name__ == "__main__":
    main()
