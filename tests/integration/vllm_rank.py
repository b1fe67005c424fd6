"""One rank of a 2-process `trainer=fsdp engine=vllm` run under torchrun (test_vllm.py starts it): trains with the
given overrides and writes to OUT/rank<r>.json what `EngineProbe` measured on this rank's engine and what
`ShardProbe` saw of the policy while the engine generated and of the KL reference in the update."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # torchrun puts only this folder on the path

import lightning as L  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from empo2.config import load_config  # noqa: E402
from empo2.rollout.engines import VLLMEngine  # noqa: E402
from empo2.utils import quiet_libraries  # noqa: E402
from empo2.workflows.train import train  # noqa: E402
from tests.integration.test_vllm import EngineProbe  # noqa: E402


class ShardProbe(L.Callback):
    """Whether every weight of the policy was a shard (none gathered) at each `generate` of the engine (actions,
    tips, validation, the probe's own), whether the KL reference is sharded, and the update's `actor/kl_ref`."""

    def __init__(self):
        self.sharded_at_generate: list[bool] = []
        self.ref_sharded, self.kl_ref = None, []

    def setup(self, trainer, pl_module, stage):
        generate = VLLMEngine.generate

        def probed(engine, *args, **kwargs):
            self.sharded_at_generate.append(all(isinstance(p, DTensor) for p in pl_module.policy.parameters()))
            return generate(engine, *args, **kwargs)

        VLLMEngine.generate = probed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch.last and "actor/kl_ref" in pl_module.last_step:  # an optimiser step with its KL term
            self.kl_ref.append(pl_module.last_step["actor/kl_ref"])
        if pl_module.ref_policy is not None:
            self.ref_sharded = all(isinstance(p, DTensor) for p in pl_module.ref_policy.parameters())


if __name__ == "__main__":
    quiet_libraries()
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    probe, shards = EngineProbe(json.loads((out / "prompts.json").read_text())), ShardProbe()
    train(load_config(overrides), callbacks=[probe, shards])
    import torch.distributed as dist

    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps({
        "gaps": probe.gaps, "sharded_at_generate": shards.sharded_at_generate, "ref_sharded": shards.ref_sharded,
        "kl_ref_finite": bool(shards.kl_ref) and all(math.isfinite(k) for k in shards.kl_ref)}))
