"""H3 Hybrid: a ComfyUI node pack for MiniMax H3 and VDN-H3.

The host imports this folder as a package and registers the nodes ``comfy_entrypoint`` lists (its V3 way); the
browser loads ``nodes/web`` (the migration of workflows saved with earlier node inputs). Importing it touches no
GPU and no host module: the nodes are imported when the host asks for them.
"""

import os
import sys

# h3_core is a plain package beside the nodes; the host imports this folder as a package of its own name, so
# its root goes on the path (at the end: the host's own top-level modules keep their names).
_ROOT = os.path.dirname(os.path.abspath(__file__))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

WEB_DIRECTORY = "./nodes/web"


async def comfy_entrypoint():
    """The pack's ``ComfyExtension`` (the host's V3 registration): its nodes and model folders."""
    from .nodes import H3Extension
    from .nodes._host import keep_compiled_kernels, register_folders, say

    register_folders()
    caches = keep_compiled_kernels()
    say("compiled kernels are kept in " + ", ".join(sorted(set(caches.values()))))
    return H3Extension()


__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
