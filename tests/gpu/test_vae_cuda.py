"""GPU checks of the video decode: every way of copying frames off the device, the compiled blocks and the
streamed-weights fallback give the frames of the plain CPU decode (skipped without CUDA)."""

import pytest
import torch

from h3_core.media.tiling import decode_video
from h3_core.models.video_vae import VideoVAE, VideoVAEConfig, keeps_fp32

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TINY = VideoVAEConfig(
    decoder_layers=2, decoder_heads=2, decoder_head_dim=32, block_out_channels=(8,) * 6, norm_groups=4
)


@pytest.fixture(scope="module")
def vae_cpu():
    torch.manual_seed(0)
    vae = VideoVAE(TINY).eval()
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0, 0.05)
    return vae


@pytest.fixture(scope="module")
def z():
    # 12 latents → 2 temporal windows; 40×52 latents → a 3×4 grid of 256 px tiles at 640×832.
    return torch.randn(24, 12, 40, 52, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def expected(vae_cpu, z):
    return decode_video(vae_cpu, z, tiles_per_batch=3)


def cuda_copy(vae_cpu):
    vae = VideoVAE(TINY).eval()
    vae.load_state_dict(vae_cpu.state_dict())
    return vae.cuda()


@pytest.mark.parametrize("where", ["pageable", "pinned", "device"])
def test_frames_copied_off_the_device_in_every_way_are_the_cpu_frames(vae_cpu, z, expected, where):
    vae = cuda_copy(vae_cpu)
    out = {
        "pageable": None,
        "pinned": torch.empty(expected.shape, pin_memory=True),
        "device": torch.empty(expected.shape, device="cuda"),
    }[where]
    frames = decode_video(vae, z.cuda(), tiles_per_batch=3, out=out)
    assert frames.device.type == ("cuda" if where == "device" else "cpu")
    torch.testing.assert_close(frames.cpu(), expected, atol=2e-4, rtol=0)


def test_compiled_blocks_give_the_eager_frames(vae_cpu, z, expected):
    vae = cuda_copy(vae_cpu)
    frames = decode_video(vae, z.cuda(), tiles_per_batch=4, compile="auto")
    plain = decode_video(vae, z.cuda(), tiles_per_batch=4, compile="off")
    torch.testing.assert_close(frames, expected, atol=2e-4, rtol=0)
    torch.testing.assert_close(plain, expected, atol=2e-4, rtol=0)


def test_streamed_decoder_blocks_give_the_resident_frames(vae_cpu, z, expected):
    vae = cuda_copy(vae_cpu)
    said = vae.offload_decoder_blocks()
    assert "host memory" in said
    block = vae.decoder.transformer_blocks[0]
    assert all(p.device.type == "cpu" and p.is_pinned() for p in block.parameters())
    frames = decode_video(vae, z.cuda(), tiles_per_batch=2)
    assert all(p.device.type == "cpu" for p in block.parameters())
    torch.testing.assert_close(frames, expected, atol=2e-4, rtol=0)


def test_half_precision_decode_stays_close(vae_cpu, z, expected):
    vae = cuda_copy(vae_cpu)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.startswith("decoder.transformer_blocks.") and not keeps_fp32(name):
                p.data = p.data.half()
    frames = decode_video(vae, z.cuda(), tiles_per_batch=4)
    assert torch.isfinite(frames).all()
    assert (frames - expected).abs().max() < 2e-2


def test_replayed_graphs_give_the_frames_of_compiled_batches_run_one_by_one(vae_cpu, z, monkeypatch):
    from h3_core.media import graph_replay, tiling

    vae = cuda_copy(vae_cpu)
    made = []

    class Counting(graph_replay.GraphReplay):
        def __init__(self, fn, shapes=2):
            super().__init__(fn, shapes)
            made.append(self)

    monkeypatch.setattr(tiling, "GraphReplay", Counting)
    replayed = decode_video(vae, z.cuda(), tiles_per_batch=3, compile="auto")
    # 4 tiles per row in batches of 3 and 1: a graph for each shape, both captured
    assert len(made) == 1 and len(made[0].graphs) == 2 and not made[0].failed

    class Unreplayed(graph_replay.GraphReplay):
        def __call__(self, x):
            return self.fn(x)

    monkeypatch.setattr(tiling, "GraphReplay", Unreplayed)
    one_by_one = decode_video(vae, z.cuda(), tiles_per_batch=3, compile="auto")
    assert torch.equal(replayed, one_by_one)


def test_graph_replay_captures_on_the_second_call_and_runs_other_shapes_as_written():
    from h3_core.media.graph_replay import GraphReplay

    calls = []

    def fn(x):
        calls.append(tuple(x.shape))
        return (x * 2).sin() + 1

    replay = GraphReplay(fn, shapes=1)
    a, b, c = (torch.randn(4, 8, device="cuda") for _ in range(3))
    assert torch.equal(replay(a), fn(a))  # first call: as written
    assert len(replay.graphs) == 0
    out_b = replay(b)  # second: captured, then replayed
    assert len(replay.graphs) == 1
    torch.testing.assert_close(out_b, fn(b), rtol=0, atol=0)
    captures = len(calls)
    out_c = replay(c)  # third: replayed, fn not called
    assert len(calls) == captures
    torch.testing.assert_close(out_c, fn(c), rtol=0, atol=0)
    assert out_c.data_ptr() == out_b.data_ptr()  # the graph's own output, overwritten
    other = torch.randn(2, 8, device="cuda")
    for _ in range(3):  # over the shape limit: always as written
        torch.testing.assert_close(replay(other), fn(other), rtol=0, atol=0)
    assert len(replay.graphs) == 1


def test_a_graph_that_cannot_be_captured_falls_back_to_running_as_written():
    from h3_core.media.graph_replay import GraphReplay

    def syncs(x):
        return x + x.sum().item()  # a host synchronisation: not allowed while capturing

    replay = GraphReplay(syncs)
    x = torch.ones(3, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(replay(x), x + 3)
    assert replay.failed and not replay.graphs
