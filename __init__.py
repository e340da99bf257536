"""H3 Hybrid: a ComfyUI node pack for MiniMax H3 and VDN-H3.

The host imports this folder as a package and registers the nodes ``comfy_entrypoint`` lists (its V3 way); the
browser loads ``nodes/web`` (the migration of workflows saved with earlier node inputs). Registering changes
nothing else in the process: no GPU, no environment variable, no thread, no garbage-collector setting; the pack's
warm-up starts when the first prompt holding one of its nodes is posted (``nodes._host.warm_up_on_first_h3_prompt``).
The nodes reach the library as this package's ``h3_core``; nothing is added to the host's ``sys.path``.
"""

WEB_DIRECTORY = "./nodes/web"


async def comfy_entrypoint():
    """The pack's ``ComfyExtension`` (the host's V3 registration): its nodes and model folders."""
    from .nodes import NODES, H3Extension
    from .nodes._host import register_folders, warm_up_on_first_h3_prompt

    register_folders()
    warm_up_on_first_h3_prompt(node.__name__ for node in NODES)  # each node's id is its class's name
    return H3Extension()


__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
