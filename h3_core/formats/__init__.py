"""Checkpoint files: their formats, key maps and quantisations, and the one loader of each model."""
