"""Several ranks for one clip (``torch.distributed``): the sequence's rows split across ranks between blocks, and
Ulysses all-to-all exchanges to whole sequences of a rank's heads for attention and back."""

from .exchange import exchange_blocks, gather_rows, heads_to_rows, rows_to_heads
from .sharding import balanced_splits, head_ranges, row_shards
from .spread import spread_in_order
from .ulysses import RankGroup, SequenceShards, ulysses_attention
from .workers import RanksCancelled, RankWorkers, shared_cancel

__all__ = [
    "SequenceShards",
    "RankGroup",
    "balanced_splits",
    "head_ranges",
    "row_shards",
    "rows_to_heads",
    "heads_to_rows",
    "gather_rows",
    "exchange_blocks",
    "ulysses_attention",
    "spread_in_order",
    "RankWorkers",
    "RanksCancelled",
    "shared_cancel",
]
