"""What the two VAEs share: their latent statistics."""

from __future__ import annotations

import torch


class LatentStats:
    """Per-channel latent normalisation from ``self.cfg.latents_mean`` / ``latents_std``; latents have the
    channel axis ``LATENT_TRAILING_DIMS`` axes from the end."""

    LATENT_TRAILING_DIMS = 1

    def _stats(self, z: torch.Tensor):
        shape = (-1,) + (1,) * self.LATENT_TRAILING_DIMS
        return tuple(
            torch.tensor(s, dtype=z.dtype, device=z.device).view(shape)
            for s in (self.cfg.latents_mean, self.cfg.latents_std)
        )

    def normalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        """Raw latents → model space ``(z − mean) / std``."""
        mean, std = self._stats(z)
        return (z - mean) / std

    def denormalize_latents(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return z * std + mean
