"""The rows a DiT evaluation runs on when one process runs them all: the dense attention's (no context) and VDN-H3's
``HybridContext``. ``parallel.SequenceShards`` has the same two methods for a rank's rows of a sequence split among
ranks, so ``H3DiT.forward`` never asks which it was given."""

from __future__ import annotations

import torch

__all__ = ["WholeSequence", "WHOLE_SEQUENCE"]


class WholeSequence:
    def local_rows(self, rows: int, kinds) -> tuple[slice, list[tuple[torch.Tensor, slice]]]:
        """The rows run here of a sequence of ``rows`` rows (all of them), and for each kind of row (``kinds``: each
        kind's places in the sequence) its places among them and which of the kind's rows they are (all)."""
        return slice(0, rows), [(index, slice(None)) for index in kinds]

    def velocities(self, heads, timestep_index, kinds, picks) -> tuple[torch.Tensor, torch.Tensor]:
        """The output heads on the video and audio rows, ``heads(timestep_index, video_places, audio_places)``:
        ``picks`` are those two kinds' (places, which) from ``local_rows``, ``kinds`` their places in the sequence."""
        (video, _), (audio, _) = picks
        return heads(timestep_index, video, audio)


WHOLE_SEQUENCE = WholeSequence()
