"""H3 Hybrid: a ComfyUI node pack for MiniMax H3 and VDN-H3.

The host imports this folder as a package and registers the nodes ``comfy_entrypoint`` lists (its V3 way); the
browser loads ``nodes/web`` (the migration of workflows saved with earlier node inputs). Importing it touches no
GPU and no host module: the nodes are imported when the host asks for them. The nodes reach the library as this
package's ``h3_core``; nothing is added to the host's ``sys.path``.
"""

WEB_DIRECTORY = "./nodes/web"


async def comfy_entrypoint():
    """The pack's ``ComfyExtension`` (the host's V3 registration): its nodes and model folders."""
    from .nodes import H3Extension
    from .nodes._host import (
        import_compilers_in_background,
        keep_compiled_kernels,
        register_folders,
        say,
        set_aside_startup_objects,
    )

    register_folders()
    set_aside_startup_objects("at start-up")
    caches = keep_compiled_kernels()
    say("compiled kernels are kept in " + ", ".join(sorted(set(caches.values()))))
    import_compilers_in_background()  # after the cache folders are named: FA4 reads them when it is imported
    return H3Extension()


__all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]
