"""Reservation epochs on a rank (common/kv/epochs.py): a push writes only while its epoch is
its blocks' live one; a block given to a newer epoch refuses the older one's rows."""

from __future__ import annotations

import threading

import torch

from common.kv.epochs import BlockEpochs


def test_a_block_given_out_again_refuses_the_old_epoch() -> None:
    epochs = BlockEpochs(8)
    first, second = torch.tensor([1, 2]), torch.tensor([2, 3])
    epochs.give(first, 1)
    assert epochs.live(first, 1) and not epochs.live(first, 0)
    epochs.give(second, 2)  # block 2 changed hands
    assert not epochs.live(first, 1)
    assert epochs.live(torch.tensor([1]), 1)  # block 1 is still epoch 1's
    assert epochs.live(second, 2)
    epochs.give(second, 1)  # an older word changes nothing: epochs only grow
    assert not epochs.live(second, 1)


def test_a_push_that_overtakes_its_epoch_makes_it_live() -> None:
    epochs = BlockEpochs(4)
    blocks = torch.tensor([0, 1])
    epochs.give(blocks, 3)
    with epochs.hold(blocks, 5) as ok:  # epoch 5 was given out; this rank has not heard yet
        assert ok
    assert not epochs.live(blocks, 3)  # the old epoch's late rows no longer land
    epochs.give(blocks, 5)  # the leader's word arrives after
    assert epochs.live(blocks, 5)


def test_a_give_waits_for_the_write_it_holds() -> None:
    """A segment's check and its write are one step for a concurrent give."""
    epochs = BlockEpochs(4)
    blocks = torch.tensor([0])
    epochs.give(blocks, 1)
    written, gave = threading.Event(), threading.Event()

    def give() -> None:
        epochs.give(blocks, 2)
        gave.set()

    with epochs.hold(blocks, 1) as ok:
        assert ok
        threading.Thread(target=give).start()
        assert not gave.wait(0.2)  # the give waits while the write holds the blocks
        written.set()
    assert gave.wait(5) and not epochs.live(blocks, 1)
    epochs.count_drop()
    assert epochs.dropped == 1
