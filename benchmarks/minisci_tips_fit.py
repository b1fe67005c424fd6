"""How well the cached `minisci-tips` prior fits its own training data, per kind of example.

For 96 random training examples of each kind (tip-free action, action with a tip block, tip request):
mean loss per target token and how many targets greedy decoding reproduces exactly. An ability whose
training loss is still high was not learned, whatever the calibration shows; `act_with_tips` below `act`
means the tips in the prompt are read.

    python benchmarks/minisci_tips_fit.py
"""

from __future__ import annotations

import random
import statistics

import torch

from empo2.models import _load_local
from empo2.prior import HISTORY_TURNS, MAX_PROMPT_TOKENS, MAX_REQUEST_TOKENS, _batch, ready_path
from empo2.prior_tips import TIP_FREE, TIP_REQUEST, WITH_TIPS, TipPriorSettings, dev_episodes, tip_examples
from empo2.rollout.prompts import PromptBuilder


def main(per_kind: int = 96, batch: int = 16) -> None:
    torch.set_num_threads(2)
    settings = TipPriorSettings()
    path = ready_path("minisci-tips", settings)
    if path is None:
        raise SystemExit("no minisci-tips with the current settings: build it first (any run with model=minisci_tips)")
    model, tok = _load_local(path, torch.float32)  # the tokenizer it was trained with
    model.eval()
    builder = PromptBuilder(tok, max_prompt_tokens=MAX_PROMPT_TOKENS, history_turns=HISTORY_TURNS,
                            max_request_tokens=MAX_REQUEST_TOKENS)
    examples = tip_examples(builder, dev_episodes(settings), settings)
    rng = random.Random(0)
    print("| kind | loss per target token | greedy target exact |\n|---|---|---|")
    for kind in (TIP_FREE, WITH_TIPS, TIP_REQUEST):
        pool = rng.sample([(p, a) for k, p, a in examples if k == kind], per_kind)
        losses, exact = [], 0
        for i in range(0, len(pool), batch):
            ids, mask, labels = _batch(pool[i:i + batch], tok.pad_token_id)
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, T-1, V)
            target = labels[:, 1:]  # (B, T-1): token t is predicted at position t-1
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                                                    reduction="none")
            for r in range(target.shape[0]):
                m = target[r] != -100
                losses.append(nll[r][m].mean().item())
                exact += bool((logits[r].argmax(-1)[m] == target[r][m]).all())
        print(f"| {kind} | {statistics.fmean(losses):.3f} | {exact}/{per_kind} |")


if __name__ == "__main__":
    main()
