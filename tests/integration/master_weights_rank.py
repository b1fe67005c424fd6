"""One rank of a 2-process `trainer=fsdp` run under torchrun (test_master_weights.py starts it): trains with the
given overrides and writes what `DtypeProbe` saw on this rank to OUT/dtypes<r>.json."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # torchrun puts only this folder on the path

from empo2.config import load_config  # noqa: E402
from empo2.utils import quiet_libraries  # noqa: E402
from empo2.workflows.train import train  # noqa: E402
from tests.integration.test_master_weights import DtypeProbe  # noqa: E402

if __name__ == "__main__":
    quiet_libraries()
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    probe = DtypeProbe()
    train(load_config(overrides), callbacks=[probe])
    import torch.distributed as dist

    restored = {k: v if isinstance(v, str) else v.tolist() for k, v in probe.restored.items()}
    (out / f"dtypes{dist.get_rank()}.json").write_text(json.dumps({**probe.seen, "restored": restored}))
