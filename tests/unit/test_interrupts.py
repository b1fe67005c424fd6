import os
import signal

import pytest

from empo2.cli import interrupt
from empo2.utils import uninterrupted
from empo2.utils.errors import Interrupted


@pytest.fixture
def handler():
    previous = signal.signal(signal.SIGINT, interrupt)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_checkpoint_write_waits_for_its_end(handler):
    done = []
    with pytest.raises(Interrupted):
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGINT)  # delivered here, in the middle of the block
            done.append("rest of the write")
    assert done == ["rest of the write"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # a second Ctrl-C stops at once


def test_ctrl_c_outside_a_write_stops_at_once_and_a_failing_write_keeps_its_error(handler):
    with pytest.raises(Interrupted):
        os.kill(os.getpid(), signal.SIGINT)
    signal.signal(signal.SIGINT, interrupt)
    with pytest.raises(OSError, match="disk full"):  # the block's own error, not the held interrupt
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError("disk full")
    with uninterrupted():  # nothing held over from the failed block
        pass


def test_a_ctrl_c_that_a_finalizer_swallows_still_stops_the_run_where_its_iteration_ends(tmp_path, capsys):
    """Python drops an exception raised while a `__del__` runs ("Exception ignored"): the interrupt comes back
    where the iteration ends, and no traceback of the dropped one reaches the console."""
    from types import SimpleNamespace

    from empo2.cli import _interruptible
    from empo2.lit.checkpoint_io import IterationCheckpoint

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs, and raises, inside this finalizer

    hook, finished = IterationCheckpoint(tmp_path, every=1000), []

    def run():
        for iteration in range(5):
            Finalized()  # collected at once
            finished.append(iteration)
            hook.on_train_epoch_end(SimpleNamespace(current_epoch=iteration), None)

    with pytest.raises(SystemExit) as stop:
        _interruptible(run, cfg=None, overrides=[])
    assert stop.value.code == 130 and finished == [0]
    err = capsys.readouterr().err
    assert "Exception ignored" not in err and "no iteration finished" in err
