import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread in every process a test starts, as in the test process below: a run's ranks, engines and
# environments, and the suite's two workers, share two cores, and a second thread per process only spins waiting
# for a core another process holds (a tiny training run: 12.1 CPU-s with two threads, 10.5 with one, same wall time).
os.environ.setdefault("OMP_NUM_THREADS", "1")

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
