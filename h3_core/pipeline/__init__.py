"""From conditioning to latents: the packed layout, the noise schedule and the sampler."""
