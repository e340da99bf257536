"""The inputs of the host's own nodes that the native VDN-H3 workflows use, as ComfyUI 0.38 defines them, recorded from
its source (Comfy-Org/ComfyUI, read in the public code index at the commits named): per node class, its inputs in
order as ``(name, kind)`` with kind "link" (a socket) or "widget" (a value in ``widgets_values``), and the extra
widget values the frontend stores after some widgets (``control_after_generate``, an image upload)."""

COMMITS = {
    "comfy_extras/nodes_minimax_h3.py": "13a83ce7a8a61dc022a77d1dc5de559e5b1b3606",
    "nodes.py": "02217e36a45bcbe2dd8fa24187aa5e053d9aea2e",
    "comfy_extras/nodes_custom_sampler.py": "4be318aa1a66b91c028028cb587b6c27848fb6bf",
    "comfy_extras/nodes_video.py": "39b885faf94458563e272c4881fa369717567462",
    "comfy_extras/nodes_audio.py": "3fa38fd9cc20446bc3486e8306e8013121775397",
}

L, W = "link", "widget"
NATIVE_NODES = {
    # nodes.py
    "UNETLoader": ("nodes.py", [("unet_name", W), ("weight_dtype", W)], 0),
    "CLIPLoader": ("nodes.py", [("clip_name", W), ("type", W), ("device", W)], 0),
    "VAELoader": ("nodes.py", [("vae_name", W)], 0),
    "VAEDecode": ("nodes.py", [("samples", L), ("vae", L)], 0),
    "LoadImage": ("nodes.py", [("image", W)], 1),  # + the upload widget
    # comfy_extras/nodes_minimax_h3.py
    "MiniMaxH3ImageToVideo": (
        "comfy_extras/nodes_minimax_h3.py",
        [
            ("clip", L),
            ("vae", L),
            ("prompt", W),
            ("width", W),
            ("height", W),
            ("length", W),
            ("first_frame", L),
            ("last_frame", L),
        ],  # fmt: skip
        0,
    ),
    # comfy_extras/nodes_custom_sampler.py
    "RandomNoise": ("comfy_extras/nodes_custom_sampler.py", [("noise_seed", W)], 1),  # + control_after_generate
    "KSamplerSelect": ("comfy_extras/nodes_custom_sampler.py", [("sampler_name", W)], 0),
    "BasicScheduler": (
        "comfy_extras/nodes_custom_sampler.py",
        [("model", L), ("scheduler", W), ("steps", W), ("denoise", W)],
        0,
    ),
    "BasicGuider": ("comfy_extras/nodes_custom_sampler.py", [("model", L), ("conditioning", L)], 0),
    "SamplerCustomAdvanced": (
        "comfy_extras/nodes_custom_sampler.py",
        [("noise", L), ("guider", L), ("sampler", L), ("sigmas", L), ("latent_image", L)],
        0,
    ),
    # comfy_extras/nodes_audio.py
    "VAEDecodeAudio": ("comfy_extras/nodes_audio.py", [("samples", L), ("vae", L)], 0),
    # comfy_extras/nodes_video.py
    "CreateVideo": (
        "comfy_extras/nodes_video.py",
        [("images", L), ("fps", W), ("audio", L), ("bit_depth", W), ("color_space", W), ("codec", W)],
        0,
    ),
    "SaveVideo": (
        "comfy_extras/nodes_video.py",
        [("video", L), ("filename_prefix", W), ("format", W), ("codec", W)],
        0,
    ),
}

# this pack's node (checked against the running server's /object_info by the host tests)
PATCH_NODE = (
    "H3VDNPatch",
    [
        ("model", L),
        ("linear_branch", W),
        ("window_radius", W),
        ("window_chunk", W),
        ("window_anchors", W),
        ("window_backend", W),
        ("attention_precision", W),
        ("compile", W),
    ],  # fmt: skip
)
