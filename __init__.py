"""H3 Hybrid: a ComfyUI node pack for MiniMax H3 and VDN-H3.

Importing this package registers the pack's nodes with the host and touches no GPU.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = None
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
