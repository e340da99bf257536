"""h3_core: MiniMax H3 / VDN-H3 in plain PyTorch. Imports nothing from ComfyUI."""

__version__ = "0.1.0"
