import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from tests.real_parts import require  # noqa: E402

# One intra-op thread: tiny models gain nothing from more, and the JVMs and other tests share the two cores.
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs(*parts): real parts the test runs on (tests/real_parts.py); "
                                       "missing, the test skips, or fails under CI=true")


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        require(*mark.args)
