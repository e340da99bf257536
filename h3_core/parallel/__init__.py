"""Several ranks for one clip (``torch.distributed``): the sequence's rows split across ranks between blocks, and
Ulysses all-to-all exchanges to whole sequences of a rank's heads for attention and back."""

from .exchange import exchange_blocks, first_rank, gather_kind, gather_rows, heads_to_rows, rows_to_heads
from .follow import following_solver, leading_solver
from .sharding import balanced_splits, head_ranges, row_shards
from .spread import spread_in_order
from .ulysses import RankGroup, SequenceShards, ulysses_attention
from .weights import receive_weights, send_weights, weight_names
from .workers import HeldRaise, RanksCancelled, RankWorkers, shared_cancel

__all__ = [
    "SequenceShards",
    "RankGroup",
    "balanced_splits",
    "head_ranges",
    "row_shards",
    "rows_to_heads",
    "heads_to_rows",
    "gather_rows",
    "gather_kind",
    "exchange_blocks",
    "ulysses_attention",
    "spread_in_order",
    "RankWorkers",
    "RanksCancelled",
    "shared_cancel",
    "HeldRaise",
    "first_rank",
    "leading_solver",
    "following_solver",
    "weight_names",
    "send_weights",
    "receive_weights",
]
