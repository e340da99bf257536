"""ComfyUI's native MiniMax H3 DiT as the host runs it, re-derived for the tests (the test host, ComfyUI 0.3.75, has
no native H3, and no host code is copied here). It follows Comfy-Org/ComfyUI ``comfy/ldm/minimax/model.py`` at
``NATIVE_COMMIT``, written again from reading it; each piece names the native function it follows.

What the VDN-H3 patch relies on, and this model reproduces:
  * the packed layout ``[text | cond / reference rows | target audio | target video]`` (``PackedLayout``): its
    segments ``(start, stop, kind)``, its ``signature`` and its float64 ``(t, h, w)`` positions;
  * ``Attention``: one ``qkv_proj`` stacked [q; k; v] without bias, per-head ``q_norm`` / ``k_norm`` and, with a
    rotation table, the split-half RoPE of comfy-kitchen's ``rms_rope_split_half_`` (which refuses float64, so
    here reproduced from the table: cos at ``[..., 0, 0]``, sin at ``[..., 1, 0]``, channel i with i + rot/2);
  * ``DiTBlock.forward(x, t_emb, mod_segments, rope_freqs, transformer_options, attention=None)``: the AdaLN
    segments, ``h`` (the normed, modulated input) handed to ``attention(h, rope_freqs=..., transformer_options=...)``;
  * the block loop of ``_forward``: ``transformer_options["minimax_h3_layout"]`` published before the blocks,
    ``transformer_options["block_index"] = i`` per block, and ``patches_replace["dit"][("double_block", i)]``
    called with ``{"img", "t_emb", "mod_segments", "rope_freqs", "layout", "transformer_options"}`` and
    ``{"original_block": wrap}``, where ``wrap(args)`` runs the block with ``attention=args.get("attention")``.
Where the host's layers cast: the fp32 islands (patch projections, time embedder, output heads) run here in the
layers' own dtype, so the whole model runs in one dtype (fp64 in the exactness tests). The rotary angles are
formed in fp32 as the host forms them (its ``inv_freq`` buffer is fp32). Not reproduced: the PDD head bank
(one output head), training-mode kernels, prefetch and the compiler's allocation graphs (no-ops on the CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

NATIVE_COMMIT = "2c64d4aa3cc63920c1a2875d6fe6ab2d24ff074f"
RESCALE = 5.0 / 3.0  # FRAME_RESCALE: rotary units per pixel frame
PER_LATENT = (1, 4, 4, 4, 4)  # FRAME_PER_TOKEN
COND_T_VIDEO, COND_T_AUDIO = 0.999, 1.0  # VISUAL_COND_TIMESTEP, AUDIO_COND_TIMESTEP
TAG = {"text": 1, "video": 0, "audio": 2, "cond": 0, "ref_img": 0, "cond_audio": 2, "ref_audio": 2}


def shifted_sigma(sigma, from_shift, to_shift):
    """``time_shift_sigma``: back to the unshifted grid, then the other shift."""
    base = sigma / (from_shift + sigma * (1.0 - from_shift))
    return to_shift * base / (1.0 + (to_shift - 1.0) * base)


def to_rows(latent, patch=(1, 2, 2)):
    """``patchify_video``: ``[B, C, T, H, W]`` -> ``[B·t·h·w, C·pt·ph·pw]``."""
    pt, ph, pw = patch
    return rearrange(latent, "b c (t r) (h p) (w q) -> (b t h w) (c r p q)", r=pt, p=ph, q=pw)


def from_rows(rows, t, h, w, c, patch=(1, 2, 2)):
    """``unpatchify_video``."""
    pt, ph, pw = patch
    return rearrange(rows, "(b t h w) (c r p q) -> b c (t r) (h p) (w q)", t=t, h=h, w=w, c=c, r=pt, p=ph, q=pw)


def audio_to_rows(latent):
    """``pack_audio``: ``[1, 32, 2, T]`` -> ``[2·T, 32]``, the left channel's latents first."""
    return rearrange(latent[0], "c ch t -> (ch t) c")


def rows_to_audio(rows, channels=2):
    """``unpack_audio``."""
    return rearrange(rows, "(ch t) c -> c ch t", ch=channels)[None]


def pad_circular(latent, patch=(1, 2, 2)):
    """``comfy.ldm.common_dit.pad_to_patch_size`` (circular) on ``[B, C, T, H, W]``."""
    pt, ph, pw = patch
    pads = (-latent.shape[4] % pw, -latent.shape[3] % ph, -latent.shape[2] % pt)
    return F.pad(latent, (0, pads[0], 0, pads[1], 0, pads[2]), mode="circular")


def row_mask(mask, latent_t, lat_h, lat_w):
    """``mask_row_values``: ``[T, H, W]`` -> each 2x2 patch's largest value (edge-replicated to the padded grid),
    None when every row is >= 0.999."""
    padded = F.pad(mask[None], (0, lat_w - mask.shape[-1], 0, lat_h - mask.shape[-2]), mode="replicate")[0]
    values = padded.reshape(latent_t, lat_h // 2, 2, lat_w // 2, 2).amax(dim=(2, 4)).reshape(-1)
    return None if bool((values >= 1.0 - 1e-3).all()) else values


def area_axis(dim, patch, sqrt_area):
    """``_axis_from_sqrt_area``: ``dim // patch`` points from ``(1 − ρ)/2`` in steps ``ρ / n``, times 32."""
    ratio, n = dim / sqrt_area, dim // patch
    return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1.0 - ratio) / 2.0) * 32.0


def frame_grid(h, w):
    """``_frame_grid``: the (h, w) positions of one latent frame's patches, and the w axis."""
    root = math.sqrt(h * w)
    ys, xs = area_axis(h, 2, root), area_axis(w, 2, root)
    hh, ww = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), xs


def latent_spans(n):
    """``_video_t_spans``."""
    return [RESCALE * PER_LATENT[i % 5] for i in range(n)]


def latent_times(n, origin):
    """``_video_t_grid``: ``origin`` plus the exclusive running sum of the spans."""
    spans = torch.tensor(latent_spans(n), dtype=torch.float64)
    return float(origin) + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def reference_span(block):
    """``_ref_t_span``."""
    kind = block["kind"]
    if kind == "image":
        return 1.0
    if kind == "audio":
        return float(block["ref_audio_t"])
    if kind in ("video", "video_audio"):
        return max(float(block["ref_audio_t"]), sum(latent_spans(block["latent_t"])))
    return 0.0


def audio_positions(cursor, t, w_low, w_high):
    """``_audio_grid``."""
    g = torch.zeros(2 * t, 3, dtype=torch.float64)
    g[:, 0] = (cursor + torch.arange(t, dtype=torch.float64)).repeat(2)
    g[:t, 2], g[t:, 2] = w_low, w_high
    return g


def video_positions(vt, frame, cursor):
    """``_video_grid``."""
    g = torch.empty(vt, frame.shape[0], 3, dtype=torch.float64)
    g[:, :, 0] = latent_times(vt, cursor)[:, None]
    g[:, :, 1:] = frame[None]
    return g.reshape(-1, 3)


class PackedLayout:
    """``PackedLayout``: segments, positions and which video / audio rows are the target's."""

    def __init__(self, text_len, latent_t, latent_h, latent_w, audio_t, keyframes=None, refs=None):
        frame, w_axis = frame_grid(latent_h, latent_w)
        per_frame = frame.shape[0]
        target_w = (float(w_axis[0]), float(w_axis[-1]))
        kinds, positions = [("text", text_len)], [torch.zeros(text_len, 3, dtype=torch.float64)]
        positions[0][:, 0] = torch.arange(text_len, dtype=torch.float64)
        video_target, audio_target = [], []

        def add(kind, pos, target_list, target):
            kinds.append((kind, pos.shape[0]))
            positions.append(pos)
            target_list.append(torch.full((pos.shape[0],), target))

        cursor = float(text_len) + sum(reference_span(b) for b in refs or ())
        for kf in keyframes or ():
            at = cursor + RESCALE * kf["resolved_frame_index"]
            if kf.get("latent") is not None:
                add("cond", video_positions(kf["latent"].shape[2], frame, at), video_target, False)
            if kf.get("audio_latent") is not None:
                add("cond_audio", audio_positions(at, kf["audio_latent"].shape[-1], *target_w), audio_target, False)
        if refs:
            cursor = float(text_len)
            for block in refs:
                if block["kind"] == "image":
                    r_frame, _ = frame_grid(block["latent_h"], block["latent_w"])
                    pos = torch.empty(r_frame.shape[0], 3, dtype=torch.float64)
                    pos[:, 0], pos[:, 1:] = cursor, r_frame
                    add("ref_img", pos, video_target, False)
                elif block["kind"] == "audio":
                    if block["ref_audio_t"] > 0:
                        add("ref_audio", audio_positions(cursor, block["ref_audio_t"], *target_w), audio_target, False)
                else:  # video, video_audio: the soundtrack's rows first, both from the same cursor
                    r_frame, r_w = frame_grid(block["latent_h"], block["latent_w"])
                    if block["ref_audio_t"] > 0:
                        pos = audio_positions(cursor, block["ref_audio_t"], float(r_w[0]), float(r_w[-1]))
                        add("ref_audio", pos, audio_target, False)
                    add("ref_img", video_positions(block["latent_t"], r_frame, cursor), video_target, False)
                cursor += reference_span(block)
        add("audio", audio_positions(cursor, audio_t, *target_w), audio_target, True)
        add("video", video_positions(latent_t, frame, cursor), video_target, True)
        self.position_ids = torch.cat(positions)
        self.img_update, self.audio_update = torch.cat(video_target), torch.cat(audio_target)
        self.seq_len = self.position_ids.shape[0]
        self.signature = (text_len, latent_t, latent_h, latent_w, audio_t)
        self.segments, start = [], 0
        for kind, n in kinds:
            self.segments.append((start, start + n, kind))
            start += n
        assert per_frame * latent_t == self.segments[-1][1] - self.segments[-1][0]


def rotation_table(angles, dtype):
    """``rope_rotation_table``: ``[S, rot]`` angles (halves repeated) -> ``[1, S, 1, rot/2, 2, 2]``."""
    half = angles.shape[-1] // 2
    c, s = torch.cos(angles[:, :half]), torch.sin(angles[:, :half])
    return torch.stack([c, -s, s, c], dim=-1).reshape(1, angles.shape[0], 1, half, 2, 2).to(dtype)


def norm_rope_in_place(q, k, table, q_weight, k_weight, eps, rot_dim):
    """comfy-kitchen's ``rms_rope_split_half_`` on ``[1, S, H, D]``, reproduced from the table's layout."""
    half = rot_dim // 2
    cos, sin = table[..., 0, 0], table[..., 1, 0]  # [1, S, 1, half]
    for x, w in ((q, q_weight), (k, k_weight)):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        a, b = y[..., :half], y[..., half:rot_dim]
        x.copy_(torch.cat([a * cos - b * sin, a * sin + b * cos, y[..., rot_dim:]], dim=-1))


def dense_attention(q, k, v, heads):
    """``optimized_attention`` with ``skip_reshape``: ``[1, H, S, D]`` each -> ``[1, S, H·D]``."""
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(1, q.shape[2], heads * q.shape[3])


class Attention(nn.Module):
    def __init__(self, hidden, heads, head_dim, eps):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * heads * head_dim, bias=False)
        self.q_norm, self.k_norm = nn.RMSNorm(head_dim, eps=eps), nn.RMSNorm(head_dim, eps=eps)
        self.out_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, rope_freqs=None, transformer_options={}):
        s = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.heads * self.head_dim, dim=-1)
        v = v.view(s, self.heads, self.head_dim)
        if rope_freqs is not None:
            q, k = q.reshape(1, s, self.heads, self.head_dim), k.reshape(1, s, self.heads, self.head_dim)
            norm_rope_in_place(
                q, k, rope_freqs, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rope_freqs.shape[-3] * 2
            )
            q, k = q[0], k[0]
        else:
            q, k = self.q_norm(q.view(s, self.heads, self.head_dim)), self.k_norm(k.view(s, self.heads, self.head_dim))
        heads = [t.transpose(0, 1)[None] for t in (q, k, v)]
        return self.out_proj(dense_attention(*heads, self.heads)[0])


class MLP(nn.Module):
    """SwiGLU: ``fc2(silu(gate) · up)``, ``fc1`` giving [gate; up]."""

    def __init__(self, hidden, ffn):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 2 * ffn, bias=False), nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class AdalnProj(nn.Module):
    def __init__(self, t_dim, hidden, expand, modalities):
        super().__init__()
        self.expand, self.modalities, self.hidden = expand, modalities, hidden
        self.linear = nn.Linear(t_dim, expand * hidden * modalities)

    def forward(self, t_emb):
        x = self.linear(F.silu(t_emb))
        return x.view(x.shape[0] * self.modalities, self.expand * self.hidden).chunk(self.expand, dim=-1)


def modulate_(h, shift, scale, segments):
    """``_mod_scale_shift``: per segment ``h · (1 + scale[row]) + shift[row]`` in place (``row`` an index or a
    per-row index tensor)."""
    for a, b, row in segments:
        h[a:b].mul_(1.0 + scale[row]).add_(shift[row])
    return h


def gate_(x, gate, other, segments):
    """``_mod_gate``: ``x += other · gate[row]`` per segment."""
    for a, b, row in segments:
        x[a:b].addcmul_(other[a:b], gate[row])
    return x


class RefinerBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, ffn, eps):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=eps), nn.RMSNorm(hidden, eps=eps)
        self.attn, self.mlp = Attention(hidden, heads, head_dim, eps), MLP(hidden, ffn)

    def forward(self, x, transformer_options={}):
        x = self.attn(self.norm1(x), transformer_options=transformer_options).add_(x)
        return self.mlp(self.norm2(x)).add_(x)


class TokenRefiner(nn.Module):
    def __init__(self, layers, hidden, heads, head_dim, ffn, eps):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(hidden, heads, head_dim, ffn, eps) for _ in range(layers))
        self.final_norm = nn.RMSNorm(hidden, eps=eps)

    def forward(self, x, transformer_options={}):
        for block in self.blocks:
            x = block(x, transformer_options=transformer_options)
        return self.final_norm(x)


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, ffn, t_dim, eps):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=eps), nn.RMSNorm(hidden, eps=eps)
        self.attn, self.mlp = Attention(hidden, heads, head_dim, eps), MLP(hidden, ffn)
        self.adaln_proj = AdalnProj(t_dim, hidden, 6, 3)

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options={}, attention=None):
        attention = self.attn if attention is None else attention
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln_proj(t_emb)
        h = modulate_(self.norm1(x), shift1, scale1, mod_segments)
        x = gate_(x, gate1, attention(h, rope_freqs=rope_freqs, transformer_options=transformer_options), mod_segments)
        h = modulate_(self.norm2(x), shift2, scale2, mod_segments)
        return gate_(x, gate2, self.mlp(h), mod_segments)


class TimeEmbedder(nn.Module):
    def __init__(self, freq_dim, hidden, out):
        super().__init__()
        self.freq_dim = freq_dim
        self.proj_in, self.proj_out = nn.Linear(freq_dim, hidden), nn.Linear(hidden, out)

    def forward(self, t):
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = t.float()[:, None] * freqs[None]  # cosines first
        emb = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).to(self.proj_in.weight.dtype)
        return self.proj_out(F.silu(self.proj_in(emb)))


class FinalLayer(nn.Module):
    def __init__(self, hidden, t_dim, video_dim, audio_dim, eps):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.adaln_proj = AdalnProj(t_dim, hidden, 2, 1)
        self.video_out, self.audio_out = nn.Linear(hidden, video_dim), nn.Linear(hidden, audio_dim)

    def forward(self, x, t_emb, video_seg, audio_seg):
        shift, scale = self.adaln_proj(t_emb)

        def head(seg, out):
            a, b, row = seg
            return out((self.norm(x[a:b]) * (1.0 + scale[row]) + shift[row]).to(out.weight.dtype))

        return head(video_seg, self.video_out), head(audio_seg, self.audio_out)


class MiniMaxH3Model(nn.Module):
    """The host's ``MiniMaxH3Model``, by name too (parameter names as the host's, so its state dict is a native
    checkpoint's)."""

    def __init__(
        self, hidden, layers, heads, head_dim, ffn, text_dim, freq_dim, time_hidden, time_embed, rope_freqs,
        refiner_layers=2, latents_dim=24, audio_latents_dim=32, patch_size=(1, 2, 2), eps=1e-5,
        sigma_shift_video=12.0, sigma_shift_audio=3.0,
    ):  # fmt: skip
        super().__init__()
        self.hidden_size, self.patch_size, self.latents_dim = hidden, tuple(patch_size), latents_dim
        self.sigma_shift_video, self.sigma_shift_audio = sigma_shift_video, sigma_shift_audio
        video_dim = latents_dim * math.prod(self.patch_size)
        self.video_patch_proj = nn.Linear(video_dim, hidden)
        self.audio_patch_proj = nn.Linear(audio_latents_dim, hidden)
        self.condition_proj = nn.Linear(text_dim, hidden)
        self.time_embedder = TimeEmbedder(freq_dim, time_hidden, time_embed)
        self.rope = nn.Module()
        self.rope.register_buffer("inv_freq", torch.empty(rope_freqs))
        self.token_refiner = TokenRefiner(refiner_layers, hidden, heads, head_dim, ffn, eps)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, head_dim, ffn, time_embed, eps) for _ in range(layers))
        self.final_layer = FinalLayer(hidden, time_embed, video_dim, audio_latents_dim, eps)

    def rope_freqs(self, position_ids):
        """``rope_freqs``: ``[S, 3]`` -> ``[S, 6F]`` fp32 angles, each axis times the same frequencies, repeated."""
        inv_freq = self.rope.inv_freq.float()
        per_axis = position_ids.float().to(inv_freq.device)[:, :, None] * inv_freq[None, None]
        half = per_axis.flatten(1)
        return torch.cat([half, half], dim=-1)

    def condition_rows(self, payload, key, to_rows_fn, aug_key, default_aug, seed_offset):
        """``_cond_video_rows`` / ``_cond_audio_rows``: the condition latents as rows, mixed with seeded noise
        when the augmentation is below 1 (every condition restarts the same generator)."""
        aug, seed, rows = payload.get(aug_key, default_aug), int(payload.get("seed", 0)) + seed_offset, []
        for z in payload.get(key, []):
            r = to_rows_fn(z)
            if aug < 1.0:
                noise = torch.randn(r.shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
                r = aug * r + (1.0 - aug) * noise.to(r.device, r.dtype)
            rows.append(r)
        return torch.cat(rows) if rows else None

    def forward(self, x, timestep, context, transformer_options=None, minimax_payload=None, denoise_mask=None,
                audio_denoise_mask=None):  # fmt: skip
        """``_forward`` (the host's ``forward`` only wraps it and undoes the sampler's audio scale): returns the
        host's model output, the negated velocities ``[video [1, 24, T, H, W], audio [1, 32, 2, Ta]]``."""
        transformer_options = {} if transformer_options is None else transformer_options
        payload = minimax_payload or {}
        video_x, audio_x = x
        orig_t, orig_h, orig_w = video_x.shape[2:]
        video_x = pad_circular(video_x, self.patch_size)
        dtype, device = context.dtype, video_x.device
        latent_t, lat_h, lat_w = video_x.shape[2:]
        audio_t, text_len = audio_x.shape[-1], context.shape[1]
        layout = PackedLayout(text_len, latent_t, lat_h, lat_w, audio_t, payload.get("keyframes"), payload.get("refs"))
        transformer_options["minimax_h3_layout"] = layout

        shift_v = float(transformer_options.get("minimax_h3_sigma_shift_video", self.sigma_shift_video))
        shift_a = float(transformer_options.get("minimax_h3_sigma_shift_audio", self.sigma_shift_audio))
        sigma_v = float((timestep.flatten()[0] / 1000.0).float().clamp(min=1e-6))
        t_v, t_a = 1.0 - sigma_v, 1.0 - shifted_sigma(sigma_v, shift_v, shift_a)
        vis, aud = (
            float(payload.get("visual_cond_noise_aug", COND_T_VIDEO)),
            float(payload.get("audio_cond_noise_aug", COND_T_AUDIO)),
        )
        seg_t = {"text": t_v, "video": t_v, "audio": t_a, "cond": max(t_v, vis), "ref_img": max(t_v, vis),
                 "cond_audio": max(t_a, aud), "ref_audio": max(t_a, aud)}  # fmt: skip
        video_rows_t = audio_rows_t = None
        if denoise_mask is not None:
            m = row_mask(denoise_mask[0, 0].float(), latent_t, lat_h, lat_w)
            if m is not None:
                sigma = torch.tensor(sigma_v, dtype=torch.float32, device=m.device)
                rows_t = (1.0 - m * sigma).clamp(max=max(t_v, COND_T_VIDEO))
                if rows_t.unique().numel() == 1:
                    seg_t["video"] = float(rows_t[0])
                else:
                    video_rows_t = rows_t
        if audio_denoise_mask is not None:
            m = audio_denoise_mask[0, 0].float().reshape(-1)
            if not bool((m >= 1.0 - 1e-3).all()):
                rows_t = (1.0 - m * (1.0 - t_a)).clamp(max=max(t_a, COND_T_AUDIO))
                if rows_t.unique().numel() == 1:
                    seg_t["audio"] = float(rows_t[0])
                else:
                    audio_rows_t = rows_t
        levels = {t_v, t_a} | {seg_t[k] for _, _, k in layout.segments}
        for rows_t in (video_rows_t, audio_rows_t):
            if rows_t is not None:
                levels |= set(rows_t.unique().tolist())
        unique_t = sorted(levels)
        t_row = {t: i for i, t in enumerate(unique_t)}

        def per_row_index(rows_t, tag):
            values = rows_t.unique()
            base = torch.tensor([t_row[v] * 3 + tag for v in values.tolist()], dtype=torch.long, device=rows_t.device)
            return base[torch.searchsorted(values, rows_t)]

        tags = payload.get("text_token_tags")
        tags = None if tags is None else tags.view(-1).tolist()
        mod_segments = []
        for a, b, kind in layout.segments:
            base = t_row[seg_t[kind]] * 3
            if kind == "text" and tags is not None:
                start = 0
                for i in range(1, b - a + 1):
                    if i == b - a or tags[i] != tags[start]:
                        mod_segments.append((a + start, a + i, base + int(tags[start])))
                        start = i
            elif kind == "video" and video_rows_t is not None:
                mod_segments.append((a, b, per_row_index(video_rows_t, TAG[kind])))
            elif kind == "audio" and audio_rows_t is not None:
                mod_segments.append((a, b, per_row_index(audio_rows_t, TAG[kind])))
            else:
                mod_segments.append((a, b, base + TAG[kind]))

        wdtype = self.video_patch_proj.weight.dtype
        video_rows = to_rows(video_x.to(wdtype), self.patch_size)
        audio_rows = audio_to_rows(audio_x.to(wdtype))
        cond_video = self.condition_rows(
            payload, "cond_video_latents", lambda z: to_rows(z.to(wdtype), self.patch_size), "visual_cond_noise_aug",
            COND_T_VIDEO, 0,
        )  # fmt: skip
        cond_audio = self.condition_rows(
            payload, "cond_audio_latents", lambda z: audio_to_rows(z.to(wdtype)), "audio_cond_noise_aug",
            COND_T_AUDIO, 1,
        )  # fmt: skip
        all_video, all_audio = video_rows, audio_rows
        if cond_video is not None:
            img_update = layout.img_update.to(device)
            all_video = torch.empty(img_update.shape[0], video_rows.shape[1], dtype=wdtype, device=device)
            all_video[~img_update], all_video[img_update] = cond_video.to(device), video_rows
        if cond_audio is not None:
            audio_update = layout.audio_update.to(device)
            all_audio = torch.empty(audio_update.shape[0], audio_rows.shape[1], dtype=wdtype, device=device)
            all_audio[~audio_update], all_audio[audio_update] = cond_audio.to(device), audio_rows
        video_embed = self.video_patch_proj(all_video).to(dtype)
        audio_embed = self.audio_patch_proj(all_audio).to(dtype)
        text = self.token_refiner(self.condition_proj(context[0]), transformer_options=transformer_options)

        h = torch.empty(layout.seq_len, self.hidden_size, dtype=dtype, device=device)
        v_at = a_at = 0
        for a, b, kind in layout.segments:
            if kind == "text":
                h[a:b] = text
            elif kind in ("cond", "ref_img", "video"):
                h[a:b], v_at = video_embed[v_at : v_at + b - a], v_at + b - a
            else:
                h[a:b], a_at = audio_embed[a_at : a_at + b - a], a_at + b - a

        t_emb = self.time_embedder(torch.tensor(unique_t, dtype=torch.float32, device=device)).to(dtype)
        rope = rotation_table(self.rope_freqs(layout.position_ids), dtype)
        replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            if ("double_block", i) in replace:

                def wrap(args, block=block):
                    return {
                        "img": block(
                            args["img"],
                            args["t_emb"],
                            args["mod_segments"],
                            args["rope_freqs"],
                            transformer_options=args["transformer_options"],
                            attention=args.get("attention"),
                        )  # fmt: skip
                    }

                args = {"img": h, "t_emb": t_emb, "mod_segments": mod_segments, "rope_freqs": rope, "layout": layout,
                        "transformer_options": transformer_options}  # fmt: skip
                h = replace[("double_block", i)](args, {"original_block": wrap})["img"]
            else:
                h = block(h, t_emb, mod_segments, rope, transformer_options=transformer_options)

        va, vb, _ = next(s for s in layout.segments if s[2] == "video")
        aa, ab, _ = next(s for s in layout.segments if s[2] == "audio")
        v_row = per_row_index(video_rows_t, 0) // 3 if video_rows_t is not None else t_row[seg_t["video"]]
        a_row = per_row_index(audio_rows_t, 0) // 3 if audio_rows_t is not None else t_row[seg_t["audio"]]
        v, a = self.final_layer(h, t_emb, (va, vb, v_row), (aa, ab, a_row))
        video_out = from_rows(v, latent_t, lat_h // 2, lat_w // 2, self.latents_dim, self.patch_size)
        video_out = video_out[:, :, :orig_t, :orig_h, :orig_w]
        return [-video_out.to(video_x.dtype), -rows_to_audio(a).to(audio_x.dtype)]


# The parameters VDN-H3 adds to a block's attention: in the pack's own DiT under ``blocks.{i}.attn.``, in the
# branch file under ``transformer_blocks.{i}.attn.``; the native model has none of them.
BRANCH_PARTS = ("softmax_gate", "to_out_linear", "linear_attention")


def native_for(cfg) -> MiniMaxH3Model:
    """The native model of a pack ``DiTConfig``'s sizes (made on the default device, in its default dtype)."""
    return MiniMaxH3Model(
        cfg.hidden, cfg.layers, cfg.heads, cfg.head_dim, cfg.ffn, cfg.text_dim, cfg.freq_dim, cfg.time_hidden,
        cfg.time_embed, cfg.rope_freqs, refiner_layers=cfg.refiner_layers, eps=cfg.eps,
    )  # fmt: skip


def split_pack_state(state: dict) -> tuple[dict, dict]:
    """A VDN-H3 pack DiT's state dict as the native model's and the branch file's (keys as the file names them)."""
    branch = {k for k in state if any(f".attn.{part}." in k for part in BRANCH_PARTS)}
    native = {k: v for k, v in state.items() if k not in branch}
    return native, {k.replace("blocks.", "transformer_blocks.", 1): state[k] for k in branch}
