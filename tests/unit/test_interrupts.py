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
