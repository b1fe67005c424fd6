"""A checkpoint written before the rollout worker held the tip memory and the novelty counter still resumes.

`tests/data/legacy_checkpoint/iteration-0.ckpt` is the checkpoint after iteration 0 of a tiny run (`LEGACY_RUN`
below) written by the code of that layout (commit 495ed3b): the rollout callback's state holds `novelty` and
`memory` at its top level, where the callback now keeps them under `worker`. `expected.json` holds what the
uninterrupted run went on to log in iteration 1 (timings left out) and the tips its memory ended with.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from empo2.config import current_metric, load_config
from empo2.lit.callbacks import worker_state

DATA = Path(__file__).resolve().parent.parent / "data" / "legacy_checkpoint"
# one torch thread: the resumed run must do the original's float math exactly
LEGACY_RUN = ["model=tiny", "logger=none", "torch_threads=1", "trainer.iterations=2", "trainer.mini_batch_size=4",
              "trainer.micro_batch_size=2", "trainer.lr=1e-3", "trainer.val_every=1", "trainer.ckpt_every=1",
              "rollout.tasks_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens=6",
              "rollout.tip_max_new_tokens=12", "rollout.max_prompt_tokens=384", "env.max_steps=3",
              "env.val_variations=1", "algo.p=0.5", "algo.q=0.5", "trainer.val_mem=true", "seed=0",
              # the update as it ran then (the laptop-memory defaults came later; they change it by float rounding)
              "trainer.gradient_checkpointing=false", "trainer.micro_batch_tokens=null", "trainer.release_memory=false"]


def _callback_state(path: Path) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return next(v for k, v in ckpt["callbacks"].items() if k.startswith("RolloutCallback"))


def test_the_legacy_layout_is_read_as_the_workers_state():
    old = _callback_state(DATA / "iteration-0.ckpt")
    assert "worker" not in old and old["novelty"]["counts"] and old["memory"] is not None  # the old layout
    state = worker_state(old)
    assert state == {"novelty": old["novelty"], "memory": old["memory"]}
    assert worker_state({"worker": state, "iteration": 1}) is state  # the current layout as it is


@pytest.mark.slow
def test_a_legacy_checkpoint_resumes_into_the_run_it_came_from(tmp_path):
    """Resumed from the legacy checkpoint, iteration 1 logs exactly what the uninterrupted run logged, the memory
    ends with the same tips, and the new checkpoint is written in the current layout."""
    from empo2.workflows.train import train

    ckpt = tmp_path / "iteration-0.ckpt"
    shutil.copy(DATA / "iteration-0.ckpt", ckpt)
    expected = json.loads((DATA / "expected.json").read_text())
    summary = train(load_config(LEGACY_RUN + [f"run_root={tmp_path}", "run_name=resumed", f"resume={ckpt}"]))
    resumed = [{k: v for k, v in h.items() if not k.startswith("time/")} for h in summary["history"]
               if h["iteration"] == 1]
    # logged under today's metric names (the record keeps those of the version that wrote it)
    assert resumed == [{current_metric(k): v for k, v in h.items()} for h in expected["history_iteration_1"]]
    assert all(current_metric(k) == k for h in summary["history"] for k in h)  # the restored rows renamed too
    records = json.loads((Path(summary["run_dir"]) / "memory" / "records.json").read_text())
    assert [r["text"] for r in records["records"]] == expected["memory_records"]
    assert records["next_id"] == expected["memory_next_id"]
    new = _callback_state(Path(summary["checkpoint"]))
    assert set(new) == {"worker", "history", "iteration", "env_steps", "visits"} and new["iteration"] == 2
    assert len(new["worker"]["novelty"]["counts"]) >= len(_callback_state(ckpt)["novelty"]["counts"])


def test_eval_reads_the_tips_and_counts_of_a_legacy_checkpoint():
    """`empo2 eval memory=on` plays with the tips a legacy checkpoint holds."""
    from empo2.workflows.evaluate import _worker

    old = _callback_state(DATA / "iteration-0.ckpt")
    worker = _worker(load_config(LEGACY_RUN), DATA / "iteration-0.ckpt", 1, with_memory_state=True)
    try:
        assert len(worker.memory) == len(old["memory"]["records"]) > 0
        assert worker.novelty.counts == old["novelty"]["counts"]
    finally:
        for env in worker.envs:
            env.close()
