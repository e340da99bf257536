"""The per-rank memory model (h3_core.memory.ranks) against every rank's peak measured alone on an H200 for plain
Ulysses on 2, 4 and 8 ranks and the branch split 6 + 2 (bench/results/rank_shares.json), the shares it is given,
and the low-VRAM policy planning one rank's share: resident and nothing given up where the whole sequence would
need its lower-memory paths."""

import json
from pathlib import Path

import pytest
import torch

from h3_core.memory.policy import decide_placement
from h3_core.memory.predict import BlockShape, ModelForm, plan_for_memory
from h3_core.memory.ranks import rank_peaks, rank_shares
from h3_core.models.dit import DiTConfig, H3DiT
from h3_core.pipeline.geometry import audio_latents, latent_frames
from h3_core.pipeline.packing import pack_sequence

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "rank_shares.json"
GiB = 2**30
CFG = DiTConfig(hybrid=True)


def release_packed():
    """``bench/dit_step.py``'s request: 345 frames at 1344×768 with 300 text tokens."""
    return pack_sequence(torch.ones(300, dtype=torch.long), latent_frames(345), 48, 84, audio_latents(345))


def test_predictions_are_within_five_percent_of_every_measured_rank():
    shape = BlockShape.of(CFG, release_packed())
    measured = json.loads(RESULTS.read_text())["velocities_gathered"]
    checked = 0
    for layout in measured.values():
        ranks = layout.get("fake_ranks")
        if not ranks:
            continue
        shares = rank_shares(CFG, shape.rows, ranks, layout["softmax_ranks"])
        for key, figures in layout["variants"].items():
            rank = int(key.split("/rank")[1].split("-")[0])
            assert shares[rank].rows == figures["rows"] and shape.rows == layout["rows"]
            above_weights = figures["peak_gib"] - figures["allocated_before_gib"]
            predicted = rank_peaks(CFG, shape, shares[rank], fused=True)["activations"] / GiB
            assert predicted == pytest.approx(above_weights, rel=0.05), (key, predicted, above_weights)
            checked += 1
    assert checked == 10


@pytest.mark.parametrize("ranks, softmax_ranks", [(2, 0), (3, 0), (8, 0), (8, 6), (8, 5), (4, 1)])
def test_the_shares_cover_every_row_and_every_heads_two_parts(ranks, softmax_ranks):
    shares = rank_shares(CFG, 104266, ranks, softmax_ranks)
    assert [s.rank for s in shares] == list(range(ranks)) and sum(s.rows for s in shares) == 104266
    assert sum(s.softmax_heads for s in shares) == sum(s.branch_heads for s in shares) == CFG.heads
    if softmax_ranks:
        assert all(s.branch_heads == 0 for s in shares[:softmax_ranks])
        assert all(s.softmax_heads == 0 for s in shares[softmax_ranks:])


def test_more_ranks_need_less_each_and_the_weights_are_every_ranks():
    shape = BlockShape.of(CFG, release_packed())
    peaks = [rank_peaks(CFG, shape, rank_shares(CFG, shape.rows, n)[0]) for n in (2, 4, 8)]
    assert [p["activations"] for p in peaks] == sorted((p["activations"] for p in peaks), reverse=True)
    assert len({p["weights"] for p in peaks}) == 1


def test_a_softmax_rank_holds_the_fp8_buffers_on_its_heads_and_a_branch_rank_none():
    from h3_core.memory.predict import FP8_SOFTMAX_TEMPS, FUSED_ROTATE_TEMPS

    shape = BlockShape.of(CFG, release_packed())
    for share in (rank_shares(CFG, shape.rows, 2)[0], *rank_shares(CFG, shape.rows, 8, 6)[5:7]):
        exact, fp8 = (rank_peaks(CFG, shape, share, attention_precision=p) for p in ("bf16", "fp8"))
        phase = "softmax" if not share.split else "work"
        Is = shape.rows * share.softmax_heads * CFG.head_dim * shape.element
        assert fp8[phase] - exact[phase] == pytest.approx((FP8_SOFTMAX_TEMPS - FUSED_ROTATE_TEMPS) * Is)
        assert (fp8[phase] > exact[phase]) == (share.softmax_heads > 0)


def test_the_policy_plans_a_ranks_share_where_the_whole_sequence_would_give_things_up():
    with torch.device("meta"):
        form = ModelForm.of(H3DiT(CFG).to(torch.bfloat16))
    packed = release_packed()
    share = rank_shares(CFG, int(packed.positions.shape[0]), 8)[0]
    shape = BlockShape.of(CFG, packed)
    rank_total = rank_peaks(CFG, shape, share, fused=False)["total"]
    free = int(rank_total / 0.9) + GiB  # room for the rank's share, not for the whole sequence's activations
    whole = decide_placement(form, packed, placement="auto", memory="auto", free_bytes=free, steps=8)
    ranked = decide_placement(form, packed, placement="auto", memory="auto", free_bytes=free, steps=8, share=share)
    assert whole.steps and ranked.fits and ranked.resident_blocks is None and ranked.options.head_groups == 1
    assert "rank 0's share" in ranked.steps[0]
    # room for the most given up, not for the rank's share with nothing given up: the whole sequence's plan
    least = plan_for_memory(form, shape, 1, steps=8).predicted["total"]
    room = int(least / 0.9) + GiB
    assert room * 0.9 < rank_total
    tight = decide_placement(form, packed, placement="auto", memory="auto", free_bytes=room, steps=8, share=share)
    assert (
        tight.steps == decide_placement(form, packed, placement="auto", memory="auto", free_bytes=room, steps=8).steps
    )
