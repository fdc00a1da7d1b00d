"""A request's block table, and the one rule about it that its readers rely on.

The KV manager is the only writer of ``request.block_table`` and changes it in
two ways only: ``grow_table`` appends blocks to the same list; every other change
(admission, a swap-in, a load that landed short, freeing) is ``replace_table``,
which puts a new list in its place. So a reader that copied a table into a row
can tell what changed from the list alone: the same list means only the entries
past what it copied are new; another list means the row must be rewritten.
``BlockTableRows`` is that reader: the runner's block-table rows of a step.
"""
import numpy as np


def replace_table(request, blocks: list[int]) -> None:
    """Give the request a new block table (never the list it had)."""
    request.block_table = list(blocks)
    request.num_draft_marked_blocks = 0  # the new table's blocks are flagged afresh


def grow_table(request, blocks: list[int]) -> None:
    """Append blocks to the request's block table, in place."""
    request.block_table.extend(blocks)


class BlockTableRows:
    """Which block table each row of a step's table array holds, and how much of it."""

    def __init__(self, num_rows: int):
        self._owner: list[list[int] | None] = [None] * num_rows
        self._written = [0] * num_rows

    def write(self, tables: np.ndarray, requests) -> None:
        """Row b of ``tables`` = requests[b]'s block table, rewriting only what changed."""
        owner, written = self._owner, self._written
        for b, request in enumerate(requests):
            table = request.block_table
            if owner[b] is table:
                if written[b] < len(table):
                    tables[b, written[b]:len(table)] = table[written[b]:]
            else:
                tables[b, :len(table)] = table
                owner[b] = table
            written[b] = len(table)

    def forget(self, rows: slice) -> None:
        """These rows were overwritten by something else: the next write rewrites them whole."""
        self._owner[rows] = [None] * len(self._owner[rows])
