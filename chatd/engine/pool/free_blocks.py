"""The free blocks of a paged pool as a bitmap, and the runs of consecutive block ids that attention reads as one
view of the pool."""

from __future__ import annotations

from collections.abc import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """The maximal runs of consecutive ids in ``block_ids``, in order, as ``(first_block_id, num_blocks)``:
    ``[4, 5, 6, 9, 10, 2]`` gives ``[(4, 3), (9, 2), (2, 1)]``. A run is one view of the pool."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


class FreeBlocks:
    """The free block ids as a bitmap (1 = free): take or return a given id in O(1), count in O(1),
    find a run of consecutive free ids with ``bytearray.find`` (C speed)."""

    __slots__ = ("_bits", "_count")

    def __init__(self, num_blocks: int) -> None:
        self._bits = bytearray(b"\x01") * num_blocks
        self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def __contains__(self, block_id: int) -> bool:
        return self._bits[block_id] == 1

    def add(self, block_id: int) -> None:
        assert self._bits[block_id] == 0, f"block {block_id} freed twice"
        self._bits[block_id] = 1
        self._count += 1

    def remove(self, block_id: int) -> None:
        assert self._bits[block_id] == 1, f"block {block_id} is not free"
        self._bits[block_id] = 0
        self._count -= 1

    def is_run(self, start: int, length: int) -> bool:
        """Whether ids ``[start, start + length)`` are all free (and exist)."""
        return 0 <= start and self._bits.find(b"\x01" * length, start, start + length) == start

    def find_run(self, length: int) -> int:
        """The first id of the first run of ``length`` free ids, or -1."""
        return self._bits.find(b"\x01" * length)

    def runs(self) -> list[tuple[int, int]]:
        """Every maximal run of free ids as ``(start, length)``, in id order."""
        bits = self._bits
        runs: list[tuple[int, int]] = []
        start = bits.find(1)
        while start != -1:
            end = bits.find(0, start)
            if end == -1:
                end = len(bits)
            runs.append((start, end - start))
            start = bits.find(1, end)
        return runs

    def bitmap(self) -> bytes:
        return bytes(self._bits)
