"""The ComfyUI host's services, imported when a node runs (importing the pack touches neither the host's
model management nor the GPU): model folders, the device, progress, cancel and the output folder."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from ..h3_core.errors import H3InputError

CATEGORY = "H3 Hybrid"


def model_files(folder: str) -> list[str]:
    """Files the host lists in one of its model folders (``diffusion_models``, ``vae``, ``loras``, ...)."""
    import folder_paths

    return folder_paths.get_filename_list(folder)


def model_path(folder: str, name: str, what: str) -> Path:
    """The file chosen from a dropdown, resolved by the host (never joined onto a path by hand)."""
    import folder_paths

    path = folder_paths.get_full_path(folder, name) if isinstance(name, str) else None
    if path is None:
        raise H3InputError(
            f"{what}: {name!r} is not a file in the {folder} folder; pick one from the list (files "
            f"there: {', '.join(model_files(folder)[:8]) or 'none'})"
        )
    return Path(path)


def path_version(path) -> tuple | None:
    """(path, size, modification time) of a file, or None when it is missing: changes when the file does, so
    a node fingerprinted with it runs again."""
    try:
        stat = os.stat(path)
    except (OSError, TypeError):
        return None
    return (str(path), stat.st_size, stat.st_mtime_ns)


def file_version(folder: str, name) -> tuple | None:
    """``path_version`` of the file the host resolves ``name`` to in ``folder``."""
    import folder_paths

    path = folder_paths.get_full_path(folder, name) if isinstance(name, str) else None
    return path_version(path) if path else None


def model_folders(folder: str, marker: str) -> list[str]:
    """Sub-folders of the host's ``folder`` paths that hold ``marker`` (e.g. a model's config file),
    directly or one level down; their names relative to the folder path."""
    import folder_paths

    found = []
    for base in folder_paths.get_folder_paths(folder):
        root = Path(base)
        if not root.is_dir():
            continue
        for child in sorted(p for p in root.iterdir() if p.is_dir()):
            if (child / marker).is_file() or any((sub / marker).is_file() for sub in child.iterdir() if sub.is_dir()):
                found.append(child.name)
    return sorted(dict.fromkeys(found))


def model_folder(folder: str, name: str, marker: str, what: str) -> Path:
    """The folder chosen from a dropdown filled by ``model_folders``."""
    import folder_paths

    if name in model_folders(folder, marker):
        for base in folder_paths.get_folder_paths(folder):
            candidate = Path(base) / name
            if candidate.is_dir():
                return candidate
    raise H3InputError(
        f"{what}: {name!r} is not a model folder in {folder}; pick one from the list "
        f"(found: {', '.join(model_folders(folder, marker)) or 'none'})"
    )


def torch_device():
    import comfy.model_management

    return comfy.model_management.get_torch_device()


DEFAULT_DEVICE = "default"


def device_choices() -> list[str]:
    """Where a loader may place its model: ``default`` (the host's choice for that kind of model), the CPU, and
    each CUDA device this process sees."""
    import torch

    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return [DEFAULT_DEVICE, "cpu", *gpus]


def chosen_device(choice, host_default):
    """The device a loader's ``device`` choice names, or ``host_default`` (the host's device for that model) for
    ``default``."""
    import torch

    return torch.device(host_default) if choice in (None, DEFAULT_DEVICE) else torch.device(choice)


def free_memory(device) -> int:
    """Device memory free for the pack by the host's rules: what ``get_free_memory`` reports (including memory
    the host's allocator holds unused) less ``extra_reserved_memory()`` (``--reserve-vram``). Negative where what
    the device holds already reaches into the reserve (a model read to it before the user's budget was counted):
    added to that model's own bytes it gives the room the budget leaves it."""
    import comfy.model_management as mm

    return int(mm.get_free_memory(device)) - int(mm.extra_reserved_memory())


def device_budget(device, keep=()) -> int:
    """``free_memory`` plus the weights the host's loaded models hold on ``device`` (it unloads them when a model
    asks for the room), except the patchers in ``keep``."""
    import comfy.model_management as mm

    held = 0
    for loaded in mm.current_loaded_models:
        patcher = loaded.model
        if patcher is None or loaded.device != device or any(patcher.is_clone(k) for k in keep):
            continue
        held += int(loaded.model_loaded_memory())
    return free_memory(device) + held


def check_cancel() -> None:
    """Raises the host's interrupt exception when the user pressed cancel."""
    import comfy.model_management

    comfy.model_management.throw_exception_if_processing_interrupted()


class Progress:
    """The node's progress bar in the UI, fed by h3_core's ``progress(done, total)`` callbacks."""

    def __init__(self, total: int = 1):
        import comfy.utils

        self.bar = comfy.utils.ProgressBar(total)

    def __call__(self, done: int, total: int) -> None:
        self.bar.update_absolute(done, total)


def video_latent_format():
    """The host's own latent format for H3's video latent where it has one, else a host ``LatentFormat`` carrying the
    latent→RGB map of ``h3_core.media.latent_rgb`` (24 channels, 16× in space, 4× in time)."""
    import comfy.latent_formats as formats

    own = getattr(formats, "MiniMaxH3Video", None)
    if isinstance(own, type) and issubclass(own, formats.LatentFormat):
        return own()
    from ..h3_core.media.latent_rgb import LATENT_RGB_BIAS, LATENT_RGB_FACTORS

    class H3VideoLatent(formats.LatentFormat):
        latent_channels = 24
        latent_dimensions = 3
        spacial_downscale_ratio = 16
        temporal_downscale_ratio = 4
        latent_rgb_factors = [list(row) for row in LATENT_RGB_FACTORS]
        latent_rgb_factors_bias = list(LATENT_RGB_BIAS)

    return H3VideoLatent()


class PreviewProgress(Progress):
    """The progress bar with a live preview per step, made by the host's own previewer for H3's video latent
    (``latent_preview.get_previewer``: none when the user runs with previews off, a TAE where the host has one
    and the user chose it, else the latent→RGB map). ``h3_core.pipeline.sampler.denoise`` reports each step once:
    through ``on_progress`` without a previewer, through ``on_step`` (the frame with it) with one."""

    def __init__(self, total: int, device):
        import latent_preview

        super().__init__(total)
        self.previewer = latent_preview.get_previewer(device, video_latent_format())

    def preview(self, done: int, total: int, frame) -> None:
        image = self.previewer.decode_latent_to_preview_image("JPEG", frame[None])
        self.bar.update_absolute(done, total, image)

    @property
    def on_progress(self):
        """The ``progress`` callback for ``generate``: None where ``on_step`` moves the bar."""
        return self if self.previewer is None else None

    @property
    def on_step(self):
        """The ``preview`` callback for ``generate``, or None when the host sends no previews."""
        return self.preview if self.previewer is not None else None


def output_directory() -> Path:
    import folder_paths

    return Path(folder_paths.get_output_directory())


def say(message: str) -> None:
    """A line in the host's log (and its console)."""
    import logging

    logging.getLogger("h3_hybrid").info("[H3 Hybrid] %s", message)


PROMPT_FOLDER = "h3_prompts"


def warm_up_on_first_h3_prompt(node_ids) -> None:
    """Have the server start the pack's warm-up (``warm_up``) when the first prompt holding one of ``node_ids`` is
    posted — before its validation, the first moment the pack knows it will run. Until then the pack has changed
    nothing in the process. A no-op outside a ComfyUI server."""
    try:
        from server import PromptServer
    except ImportError:
        return
    server = getattr(PromptServer, "instance", None)
    if server is None:
        return
    ours = frozenset(node_ids)

    def on_prompt(json_data):
        prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
        if isinstance(prompt, dict) and any(
            isinstance(node, dict) and node.get("class_type") in ours for node in prompt.values()
        ):
            warm_up()
        return json_data

    server.add_on_prompt_handler(on_prompt)


_warm_up_lock = threading.Lock()
_warm_up_started = False


def warm_up() -> threading.Thread | None:
    """Once per process, on a thread of its own, where the compiled paths will run (CUDA with Triton): what a first
    run would meet, in the order it meets it: FA4's interface where installed, the loaders' page-locked staging buffers
    (allocated and freed: PyTorch keeps them for the first load, which gives them back), Triton's import and one
    trivial launch (``triton_forms.launch_once``; the loaders' fp8 quantiser is a Triton kernel), the first
    products and convolutions of the models' runs, the dense-attention kernels' choice
    (``choose_attention_kernels``) and the hardware video encoders' probe (``mp4.probe_hardware_encoders``). The log
    says how long they took and what was chosen. Returns the thread (None once started before, or where nothing
    compiles)."""
    global _warm_up_started
    with _warm_up_lock:
        if _warm_up_started:
            return None
        _warm_up_started = True
    from ..h3_core.triton_forms import compiles_on

    if not compiles_on("cuda"):
        return None
    thread = threading.Thread(target=_warm_up_run, name="h3-warm-up", daemon=True)
    thread.start()
    return thread


def _warm_up_run() -> None:
    from ..h3_core.media.mp4 import probe_hardware_encoders
    from ..h3_core.pipeline.first_library_calls import choose_attention_kernels, make_first_calls
    from ..h3_core.triton_forms import FA4_MODULES, TRITON_MODULES, import_compilers, launch_once

    seconds = import_compilers(FA4_MODULES)
    device = torch_device()
    on_gpu = device.type == "cuda"
    made = make_first_calls(device, "loaders") if on_gpu else {}  # the staged reader's page-locked buffers
    seconds |= import_compilers(TRITON_MODULES)
    launched = launch_once(device) if on_gpu else None  # the loaders' fp8 quantiser is a Triton kernel
    if on_gpu:  # the products and convolutions the models' runs make
        made |= make_first_calls(device, "runs")
        say(
            "the libraries' first calls made ahead: "
            + ", ".join(f"{k} {'failed' if s is None else f'{s:.2f} s'}" for k, s in made.items())
        )
    done = sorted({name.split(".")[0] for name, s in seconds.items() if s is not None})
    total = sum(s for s in seconds.values() if s is not None)
    first = "" if launched is None else f"; Triton's first launch in {launched:.1f} s"
    say(f"imported the compilers' modules ({', '.join(done)}) in {total:.1f} s{first}")
    if on_gpu:
        chosen = choose_attention_kernels(device)
        say("dense attention kernels chosen ahead: " + "; ".join(f"{k} {v}" for k, v in chosen.items()))
    start = time.perf_counter()
    try:
        encoders = probe_hardware_encoders()
    except ImportError:  # no PyAV: the nodes that write mp4 files say so when they run
        encoders = None
    if encoders is not None:
        say(
            f"hardware video encoders probed in {time.perf_counter() - start:.1f} s: "
            + "; ".join(f"{name} {'opens' if why is None else 'does not open'}" for name, why in encoders.items())
        )


def register_folders() -> None:
    """Add the pack's own model folder (saved prompt embeddings: ``models/h3_prompts``) to the host's list; a
    no-op outside ComfyUI."""
    try:
        import folder_paths
    except ImportError:
        return
    folder_paths.add_model_folder_path(PROMPT_FOLDER, os.path.join(folder_paths.models_dir, PROMPT_FOLDER))


def tell(node_id, lines: list[str]) -> None:
    """``lines`` in the log and, as the node's progress text, on the node in the UI."""
    for line in lines:
        say(line)
    if node_id is None:
        return
    from server import PromptServer

    server = PromptServer.instance
    server.send_progress_text("\n".join(lines), str(node_id), getattr(server, "client_id", None))


def host_memory_available() -> int:
    """Host memory the system can give a process now (``psutil``, which ComfyUI installs), in bytes."""
    import psutil

    return int(psutil.virtual_memory().available)


def dynamic_vram() -> bool:
    """Whether the host streams its models with dynamic VRAM (comfy-aimdo, on by default in ComfyUI 0.38:
    ``comfy.memory_management.aimdo_enabled``, set by its ``main.py`` at 02018c7e); False on hosts without it."""
    try:
        import comfy.memory_management
    except ImportError:
        return False
    return bool(getattr(comfy.memory_management, "aimdo_enabled", False))
