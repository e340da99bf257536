"""H3 Hybrid: a ComfyUI node pack for MiniMax H3 and VDN-H3.

Importing this package registers the pack's nodes (and its model folders) with the host and touches no GPU.
"""

import os
import sys

# h3_core is a plain package beside the nodes; the host imports this folder as a package of its own name, so
# its root goes on the path (at the end: the host's own top-level modules keep their names).
_ROOT = os.path.dirname(os.path.abspath(__file__))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402
from .nodes._host import register_folders  # noqa: E402

register_folders()

WEB_DIRECTORY = None
__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
