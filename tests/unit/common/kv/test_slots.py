"""token_slots: the one block-table -> cache-slot mapping, against a plain loop."""

from __future__ import annotations

import torch

from common.kv.slots import token_slots


def _loop(table: list[int], positions: list[int], block_size: int) -> list[int]:
    return [
        table[min(p // block_size, len(table) - 1)] * block_size + p % block_size for p in positions
    ]


def test_one_table() -> None:
    table, positions = [7, 2, 5], list(range(12))
    got = token_slots(torch.tensor(table), torch.tensor(positions), 4)
    assert got.tolist() == _loop(table, positions, 4)
    assert got[:4].tolist() == [28, 29, 30, 31] and got[4:6].tolist() == [8, 9]


def test_a_batch_of_tables_with_a_position_each_or_many() -> None:
    tables = torch.tensor([[3, 1, -1], [0, 4, 6]])
    one = token_slots(tables, torch.tensor([[5], [9]]), 4)[:, 0]
    assert one.tolist() == [1 * 4 + 1, 6 * 4 + 1]
    many = token_slots(tables, torch.arange(8).expand(2, -1), 4)
    assert many.tolist() == [_loop(t, list(range(8)), 4) for t in tables.tolist()]


def test_positions_past_the_table_read_its_last_block_and_padding_is_negative() -> None:
    table = torch.tensor([2, -1])
    got = token_slots(table, torch.tensor([3, 4, 13]), 4)
    assert got.tolist() == [11, -4, -3]
