"""HFEngine throughput against a bare batched `model.generate` on the same prompts.

Both sides get the same left-padded batch of real chat prompts (PromptBuilder, ScienceWorld-like
turns of varying history length), the same max_new_tokens, and stop only at EOS; greedy and sampled
decoding are measured separately. Throughput counts response tokens up to and including the first
EOS. The engine is also timed with its newline stop (what rollouts use): fewer tokens, shorter calls.
Prints a table and writes JSON (benchmarks/results/ unless a path is given).

    python benchmarks/rollout_engine.py                                  # bundled SmolLM2, 16 prompts
    python benchmarks/rollout_engine.py --prompts 32 --max-new-tokens 48 --threads 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from empo2.config import ModelConfig
from empo2.models import load_policy
from empo2.rollout.engines import HFEngine, SamplingParams
from empo2.rollout.prompts import PromptBuilder

OBSERVATIONS = [
    "This room is called the kitchen. In it, you see: a table, a fridge, a thermometer, a cup of water. "
    "You also see: a door to the hallway (that is open).",
    "You move to the hallway. In it, you see: a painting, a door to the greenhouse (that is open).",
    "The fridge is now open. In it, you see: an orange, a carton of milk.",
    "You pick up the thermometer. The thermometer reads 23 degrees celsius.",
]
TASK = "Your task is to measure the temperature of the water, then focus on the thermometer."


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    builder = PromptBuilder(tokenizer)
    prompts = []
    for i in range(n):
        turns = [(OBSERVATIONS[(i + t) % 4], f"go to room {t}") for t in range(i % 7)]  # 0..6 past turns
        prompts.append(builder.build(TASK, turns, OBSERVATIONS[i % 4]).ids)
    return prompts


def raw_generate(model, prompts, params: SamplingParams, eos: list[int], pad: int, seed: int) -> int:
    """Bare `model.generate` on the left-padded batch; returns the response tokens up to the first EOS."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (B, L)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, L)
    sample = params.temperature > 0
    kwargs = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0) if sample else \
        dict(do_sample=False)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=params.max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad, **kwargs)[:, width:]  # (B, T)
    total = 0
    for row in out.tolist():
        end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        total += end
    return total


def timed(fn, repeats: int) -> tuple[float, int]:
    """Median seconds over `repeats` calls after one warm-up, and the tokens of the last call."""
    fn()
    times, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="model preset (empo2.config.presets.PRESETS)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("out", nargs="?", default=str(Path(__file__).parent / "results" / "rollout_engine.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_policy(ModelConfig(name=args.model))
    model.eval()
    engine = HFEngine(model, tok, max_batch_size=args.prompts)  # one batch, as the bare call
    prompts = make_prompts(tok, args.prompts)
    eos, pad = sorted(engine.stops.eos), engine.pad_id
    rows = []
    for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens, stop_at_newline=False)
        newline = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens)
        raw_s, raw_tok = timed(lambda p=params: raw_generate(model, prompts, p, eos, pad, args.seed), args.repeats)
        eng_s, eng_tok = timed(lambda p=params: sum(len(g.token_ids) for g in engine.generate(prompts, p, args.seed)),
                               args.repeats)
        nl_s, nl_tok = timed(lambda p=newline: sum(len(g.token_ids) for g in engine.generate(prompts, p, args.seed)),
                             args.repeats)
        rows.append({"mode": mode, "raw_s": raw_s, "raw_tokens": raw_tok, "raw_tok_per_s": raw_tok / raw_s,
                     "engine_s": eng_s, "engine_tokens": eng_tok, "engine_tok_per_s": eng_tok / eng_s,
                     "ratio": (eng_tok / eng_s) / (raw_tok / raw_s),
                     "newline_stop_s": nl_s, "newline_stop_tokens": nl_tok, "newline_stop_tok_per_s": nl_tok / nl_s})
    print(f"{args.model}, {args.prompts} prompts (mean {statistics.mean(map(len, prompts)):.0f} tokens), "
          f"max_new_tokens {args.max_new_tokens}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'mode':8} {'raw tok/s':>10} {'engine tok/s':>13} {'ratio':>6}   {'newline stop: tok/s':>19} {'s/call':>7}")
    for r in rows:
        print(f"{r['mode']:8} {r['raw_tok_per_s']:10.1f} {r['engine_tok_per_s']:13.1f} {r['ratio']:6.2f}   "
              f"{r['newline_stop_tok_per_s']:19.1f} {r['newline_stop_s']:7.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                               "threads": torch.get_num_threads(), "repeats": args.repeats,
                               "prompt_tokens": [len(p) for p in prompts], "machine": platform.platform(),
                               "results": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    from empo2.utils import quiet_libraries

    quiet_libraries()  # weight-loading bars and INFO lines off, as in the CLI
    main()
