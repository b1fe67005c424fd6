"""The sampler/trainer gap on this machine: a float32 trainer (`trainer.precision=32-true`) scores the tokens the HF
engine sampled at float32 and at bfloat16 (`engine.dtype`), on the shipped MiniSci prior's real first-turn prompts
(or SmolLM2 with --model smollm2). vLLM's gap is measured through training, in
tests/integration/test_vllm.py.

    python benchmarks/logprob_gap.py

Per dtype: `rollout/logprob_gap_{mean,max,kl}` as training logs them (`core_algos.logprob_gap`) over
--prompts x --new-tokens sampled tokens at temperature 0.7. Writes JSON (benchmarks/results/logprob_gap.json unless
--out is given).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from empo2.algo.core_algos import logprob_gap
from empo2.config import AlgoConfig, ModelConfig, TrainerConfig
from empo2.envs import get_catalogue, make_env
from empo2.lit.data import RolloutBuffer
from empo2.lit.module import EMPO2Module
from empo2.models import load_policy
from empo2.rollout.engines import HFEngine, SamplingParams
from empo2.rollout.prompts import PromptBuilder
from empo2.rollout.types import StepSample

TEMPERATURE = 0.7


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="minisci_tips_signed")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "logprob_gap.json"))
    args = ap.parse_args()

    model, tok = load_policy(ModelConfig(name=args.model))
    builder, env, prompts = PromptBuilder(tok), make_env("minisci"), []
    for spec in get_catalogue("minisci").sample(args.prompts, "train", seed=0):
        obs, _ = env.reset(task=spec.task, variation=spec.variation)
        prompts.append(builder.build(env.task_description, [], obs).ids)
    env.close()
    trainer = EMPO2Module(model, tok, AlgoConfig(), TrainerConfig(precision="32-true"), RolloutBuffer(),
                          temperature=TEMPERATURE)
    params = SamplingParams(temperature=TEMPERATURE, max_new_tokens=args.new_tokens, logprobs=True)
    rows = []
    for name in ("hf",):
        for dtype in ("float32", "bfloat16"):
            start = time.perf_counter()
            gens = HFEngine(model, tok, dtype=dtype).generate(prompts, params, seed=0)
            samples = [StepSample(behaviour_ids=p, train_ids=p, response_ids=g.token_ids, memory=False,
                                  offpolicy=False, group_id=0, traj_id=i, step=0)
                       for i, (p, g) in enumerate(zip(prompts, gens))]
            old = torch.cat(trainer.score_behaviour(samples, 4))
            gap = logprob_gap(old, torch.cat([torch.tensor(g.logprobs) for g in gens]))
            rows.append({"engine": name, "dtype": dtype, "tokens": int(old.numel()), **gap,
                         "seconds": round(time.perf_counter() - start, 1)})
            print(f"{name:<5} {dtype:<9} tokens {rows[-1]['tokens']:>4}  |gap| mean {gap['mean']:.2e}  "
                  f"max {gap['max']:.2e}  KL {gap['kl']:.2e}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "temperature": TEMPERATURE, "trainer": "32-true", "rows": rows},
                              indent=2))


if __name__ == "__main__":
    main()
