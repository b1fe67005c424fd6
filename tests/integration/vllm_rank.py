"""One rank of a 2-process `trainer=fsdp engine=vllm` run under torchrun (test_vllm.py starts it): trains with the
given overrides and writes what `EngineProbe` measured on this rank's engine to OUT/rank<r>.json."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # torchrun puts only this folder on the path

from empo2.config import load_config  # noqa: E402
from empo2.train import train  # noqa: E402
from empo2.utils import quiet_libraries  # noqa: E402
from tests.integration.test_vllm import EngineProbe  # noqa: E402

if __name__ == "__main__":
    quiet_libraries()
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    probe = EngineProbe(json.loads((out / "prompts.json").read_text()))
    train(load_config(overrides), callbacks=[probe])
    import torch.distributed as dist

    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(probe.gaps))
