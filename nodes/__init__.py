"""ComfyUI adapters over h3_core: input validation, progress, cancel and error messages; no tensor math."""

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
