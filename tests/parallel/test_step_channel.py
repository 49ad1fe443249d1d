"""Rank 0's step messages through shared memory (parallel/step_channel.py), both ends in one
process: messages arrive in order, a message is not overwritten before every worker has read
the previous one (send waits, and with a timeout gives up), and the name can be removed once
the workers have mapped the region."""

from __future__ import annotations

import os

import pytest

from musespark.parallel.step_channel import StepChannel


def test_messages_arrive_in_order_and_wait_for_the_workers():
    rank0 = StepChannel.create(world=3)
    workers = [StepChannel(rank0.path, r, 3) for r in (1, 2)]
    rank0.unlink()
    assert not os.path.exists(workers[0].path)  # the mappings outlive the name
    rank0.send({"step": 1, "ids": list(range(100))})
    assert [w.recv() for w in workers] == [{"step": 1, "ids": list(range(100))}] * 2
    rank0.send(("step", 2))
    assert workers[0].recv() == ("step", 2)
    # worker 2 has not read step 2: step 3 may not overwrite it
    with pytest.raises(TimeoutError):
        rank0.send(("step", 3), timeout=0.05)
    assert workers[1].recv() == ("step", 2)
    rank0.send(None)
    assert [w.recv() for w in workers] == [None, None]
