"""`train(cfg) -> summary`: the library entry point behind `empo2 train`.

The EMPO² update loop (rollout collector, Lightning module, memory) is not part of this version.
What runs end to end today: the validated config, the run folder, the policy (bundled SmolLM2 by
default), the environment, and a pass of the policy over the fixed validation list of task
instances, written as `summary.json`. That is the baseline every training run is compared to.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from empo2.config import TrainConfig, to_dict
from empo2.envs import get_catalogue, make_env
from empo2.models import load_policy
from empo2.utils import atomic_write_json, make_run_dir, seed_everything

SYSTEM_PROMPT = ("You are an agent in a text environment. Reply with exactly one action from the command "
                 "grammar and nothing else.")


def validation_tasks(cfg: TrainConfig):
    """The fixed validation list: the first `val_variations` variations of `val_split` for every task, so
    two runs (and two iterations of one run) are always scored on the same instances."""
    cat = get_catalogue(cfg.env.name)
    tasks = cfg.env.tasks or cat.tasks()
    return [(t, v) for t in tasks for v in cat.split(t, cfg.env.val_split)[: cfg.env.val_variations]]


@torch.no_grad()
def play_episode(model, tok, env, task: str, variation: int, cfg: TrainConfig) -> dict:
    obs, _ = env.reset(task=task, variation=variation)
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"{env.task_description}\n\n{obs}"}]
    info, steps = {"score": 0.0, "won": False}, 0
    temperature = cfg.rollout.val_temperature
    while True:
        enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                      truncation=True, max_length=cfg.rollout.max_prompt_tokens)
        out = model.generate(**enc, max_new_tokens=cfg.rollout.max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature or None, top_p=cfg.rollout.top_p,
                             pad_token_id=tok.pad_token_id)
        action = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        res = env.step(action)
        steps += 1
        info = res.info
        messages += [{"role": "assistant", "content": info.get("parsed_action", action)},
                     {"role": "user", "content": res.obs}]
        if res.done:
            break
    return {"task": task, "variation": variation, "score": float(info["score"]), "won": bool(info["won"]),
            "steps": steps}


def train(cfg: TrainConfig) -> dict:
    t0 = time.time()
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    seed_everything(cfg.seed)
    run_dir = make_run_dir(cfg.run_root, cfg.run_name)
    model, tok = load_policy(cfg.model)
    model.eval()
    print(f"run folder: {run_dir}")
    print("the EMPO² update loop is not available in this version: scoring the policy on the fixed "
          "validation list instead")
    env_kwargs = {"action_correction": cfg.env.action_correction, "reward_scale": cfg.env.reward_scale}
    if cfg.env.max_steps is not None:
        env_kwargs["max_steps"] = cfg.env.max_steps
    env = make_env(cfg.env.name, **env_kwargs)
    episodes = []
    try:
        for task, variation in validation_tasks(cfg):
            ep = play_episode(model, tok, env, task, variation, cfg)
            episodes.append(ep)
            print(f"  {task} #{variation}: score {ep['score']:.0f} in {ep['steps']} steps")
    finally:
        env.close()
    n = max(len(episodes), 1)
    metrics = {"val/score_nomem": sum(e["score"] for e in episodes) / n,
               "val/success_nomem": sum(e["won"] for e in episodes) / n,
               "val/episodes": len(episodes), "time/total_s": time.time() - t0}
    summary = {"metrics": metrics, "episodes": episodes, "config": to_dict(cfg), "checkpoint": None,
               "mlflow_run_id": None, "run_dir": str(run_dir), "summary_path": str(Path(run_dir) / "summary.json")}
    atomic_write_json(summary["summary_path"], summary)
    print(f"val/score_nomem {metrics['val/score_nomem']:.1f}  val/success_nomem {metrics['val/success_nomem']:.2f}")
    return summary
