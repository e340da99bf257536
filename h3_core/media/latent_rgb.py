"""The linear map from H3's 24-channel video latent to RGB that ComfyUI's H3 latent format gives its live previews
(``MiniMaxH3Video.latent_rgb_factors`` and ``latent_rgb_factors_bias``). The host's comfy/latent_formats.py with the
H3 formats is not among the versions this project can read; these are the values as two public ports quote them
with that attribution (a training-preview module of an H3 trainer and a Forge registration "ported from ComfyUI
(latent_formats / supported_models)"), identical in both. Where the running host has its own H3 format, the nodes
use the host's. Rows are latent channels, columns R, G, B; the host maps ``latent · factors + bias`` from [-1, 1]
to pixels."""

LATENT_RGB_FACTORS = (
    (-0.018555, 0.024344, -0.017536),
    (0.150164, 0.137244, 0.129221),
    (0.027367, -0.050369, -0.208606),
    (-0.000793, -0.164622, -0.323161),
    (-0.048556, 0.013970, -0.074286),
    (0.011740, 0.014172, -0.006906),
    (0.061517, 0.061212, 0.110025),
    (0.035321, 0.086879, 0.110059),
    (-0.017426, 0.002997, 0.035356),
    (0.531539, 0.548819, 0.624404),
    (-0.024968, -0.040234, -0.034302),
    (-0.032549, -0.029096, -0.017221),
    (0.022609, 0.020286, 0.050661),
    (-0.084001, -0.038131, -0.020805),
    (-0.018830, 0.010412, 0.061120),
    (0.020777, 0.011196, -0.030994),
    (-0.008390, -0.012201, -0.025687),
    (-0.013281, -0.002924, 0.006331),
    (0.000260, 0.001833, -0.011038),
    (0.105471, 0.100482, 0.132106),
    (0.016529, 0.015213, 0.009999),
    (-0.014015, -0.017438, -0.019134),
    (-0.033787, -0.009984, -0.019725),
    (0.004224, 0.017284, 0.027196),
)
LATENT_RGB_BIAS = (0.057426, -0.022078, -0.071449)
