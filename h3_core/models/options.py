"""How one DiT evaluation runs, as one immutable ``RunOptions`` given to the model's forward
(``H3DiT.forward(..., run=)``) and passed down with the call to every block, attention, FFN, linear branch and the
output layer. No module holds any of it: two runs with different options can share one model."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from .block_ops import BlockOps, block_ops_for
from .branch_ops import BranchOps, branch_ops_for
from .low_memory import LowMemory, RowChunks, WholeRows, rows_form

__all__ = ["RunOptions", "PLAIN", "FINAL_CHUNK_ROWS"]

# The output layer's rows at a time: row-wise work, the same numbers as all rows at once without ``[T, hidden]``
# fp32 copies.
FINAL_CHUNK_ROWS = 16384


@dataclass(frozen=True)
class RunOptions:
    """``blocks_fused`` / ``branches_fused``: ``block_fused`` / ``branch_fused`` mode of the blocks' per-element
    work and of the linear branches (None runs the plain ops); ``head_groups``: attention a group of heads at a
    time; ``ffn_chunk_rows``: the FFN over that many rows at a time (None: all); ``branch_frames``: the branch's
    statistics that many frames at a time (None: all); ``final_chunk_rows``: the output layer over that many rows at
    a time; ``check_cancel``: called before every block (a cancel stops within one evaluation);
    ``on_out_of_memory``: called when an evaluation runs out of device memory (``run_options.Evaluations``), the
    ``LowMemory`` of a placement for less memory once the model was placed so (the evaluation then runs again with
    it), None to let the error through."""

    blocks_fused: str | None = None
    branches_fused: str | None = None
    head_groups: int = 1
    ffn_chunk_rows: int | None = None
    branch_frames: int | None = None
    final_chunk_rows: int = FINAL_CHUNK_ROWS
    check_cancel: Callable[[], None] | None = field(default=None, compare=False)
    on_out_of_memory: Callable[[], LowMemory | None] | None = field(default=None, compare=False)

    @property
    def block_ops(self) -> BlockOps:
        """The blocks' per-element work in ``blocks_fused`` mode (``block_ops``)."""
        return block_ops_for(self.blocks_fused)

    @property
    def branch_ops(self) -> BranchOps:
        """The linear branches' statistics and readout in ``branches_fused`` mode (``branch_ops``)."""
        return branch_ops_for(self.branches_fused)

    @property
    def ffn_rows(self) -> WholeRows | RowChunks:
        """How the FFN runs on its rows: all at once, or ``ffn_chunk_rows`` at a time (``low_memory``)."""
        return rows_form(self.ffn_chunk_rows)

    @property
    def low_memory(self) -> LowMemory:
        return LowMemory(self.ffn_chunk_rows, self.head_groups, self.branch_frames)

    def with_low_memory(self, options: LowMemory) -> "RunOptions":
        """These options with a memory plan's choices in place of their own."""
        return replace(
            self,
            head_groups=options.head_groups,
            ffn_chunk_rows=options.ffn_chunk_rows,
            branch_frames=options.branch_frames,
        )

    def fused(self, mode: str | None) -> "RunOptions":
        """These options with the blocks and the linear branches in ``mode``."""
        return replace(self, blocks_fused=mode, branches_fused=mode)


PLAIN = RunOptions()
