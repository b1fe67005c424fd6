"""vLLM's sleep mode as the engine drives it (GPU only, so no CPU run reaches it): sleep at level 2 (the weights
are discarded, since the next wake is always a weight sync), wake only the weights to load them, the KV cache at
the next generate, PyTorch's CUDA cache emptied before each wake, and a generate before the sync refused. The
engine is driven against a recording stand-in for `vllm.LLM`; benchmarks/gpu_smoke.py (`sleep_level2_sync`)
checks the same on a GPU with the real engine."""

import pytest
import torch

from empo2.rollout.engines.vllm import VLLMEngine


class RecordingLLM:
    """What the engine asks of `vllm.LLM`, in order."""

    def __init__(self, log, tags=True):
        self.log = log
        if not tags:  # an older vLLM whose wake_up takes no tags
            self.wake_up = lambda: log.append(("wake_up", None))

    def sleep(self, level):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, kwargs):
        self.log.append((method, [name for name, _ in kwargs["weights_iterator"]]))

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache", None))


def sleeping_engine(monkeypatch, sleep_mode=True, tags=True):
    log = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append(("empty_cache", None)))
    engine = object.__new__(VLLMEngine)  # the bookkeeping alone: no model, no vLLM
    engine.llm, engine.sleep_mode, engine._asleep = RecordingLLM(log, tags), sleep_mode, set()
    return engine, log


def test_sleep_discards_at_level_2_and_the_sync_wakes_only_the_weights_after_emptying_the_cache(monkeypatch):
    engine, log = sleeping_engine(monkeypatch)
    engine.sleep()
    engine.sleep()  # asleep already: nothing more
    assert log == [("sleep", 2)]
    with pytest.raises(RuntimeError, match="update_weights must load them before it generates"):
        engine.wake_up()
    engine.update_weights([("w", torch.zeros(1))])
    assert log[1:] == [("empty_cache", None), ("wake_up", ("weights",)), ("reload_weights", ["w"])]
    assert engine._asleep == {"kv_cache"}  # vLLM's level-2 sleep forgot the cache: nothing to reset
    engine.wake_up()  # what generate does first
    assert log[4:] == [("empty_cache", None), ("wake_up", ("kv_cache",))]
    engine.wake_up()
    engine.update_weights([("w", torch.zeros(1))])  # awake: load and drop the cache the old weights computed
    assert log[6:] == [("reload_weights", ["w"]), ("reset_prefix_cache", None)]


def test_without_sleep_mode_sleep_does_nothing(monkeypatch):
    engine, log = sleeping_engine(monkeypatch, sleep_mode=False)
    engine.sleep()
    engine.wake_up()
    assert log == []


def test_a_vllm_without_per_tag_wake_up_wakes_everything_at_the_sync(monkeypatch):
    engine, log = sleeping_engine(monkeypatch, tags=False)
    engine.sleep()
    engine.update_weights([("w", torch.zeros(1))])
    assert log == [("sleep", 2), ("empty_cache", None), ("wake_up", None), ("reload_weights", ["w"]),
                   ("reset_prefix_cache", None)]
    assert engine._asleep == set()
