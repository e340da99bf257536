"""A clip sampled by rank workers holding their own copies of the DiT (h3_core.pipeline.clip_on_ranks), on the CPU with
gloo: each worker reads the files rank 0's model came from, the weight rank 0 changed after loading (as the host's
LoRA patches change it) reaches them, and a solver only rank 0 runs (Heun: σ it picks itself) leads them; the result
is the one-process clip. Rank 0's solver stopping between evaluations stops the followers; weights held as
comfy-kitchen tensors travel as their parts."""

import pytest
import torch
from test_solvers import heun
from tiny_checkpoints import TINY_DIT, write_tiny_checkpoints

from h3_core.parallel import (
    RankGroup,
    RanksCancelled,
    RankWorkers,
    following_solver,
    leading_solver,
    receive_weights,
    send_weights,
    shared_cancel,
    weight_names,
)
from h3_core.pipeline.clip_on_ranks import ClipOnRanks, DiTSource
from h3_core.pipeline.generate import generate
from h3_core.pipeline.prompt import PromptEmbedding
from h3_core.pipeline.request import ClipRequest, Runner

CPU = torch.device("cpu")
PATCHED = "blocks.0.attn.qkv_proj.weight"


def request(steps=2):
    g = torch.Generator().manual_seed(10)
    prompt = PromptEmbedding(
        torch.randn(4, TINY_DIT.text_dim, generator=g), torch.ones(4, dtype=torch.long), features=TINY_DIT.text_dim
    )
    return dict(prompt=prompt, frames=22, width=64, height=32, steps=steps, seed=3, compile="off")


def test_workers_with_their_own_copies_and_rank_zeros_patch_give_the_one_process_clip(tmp_path):
    files = write_tiny_checkpoints(tmp_path)
    source = DiTSource(str(files.dit), str(files.linear_branch), torch.float32)
    model = source.load(CPU)
    with torch.no_grad():
        model.get_parameter(PATCHED).add_(0.05 * torch.randn(model.get_parameter(PATCHED).shape))
    asked = request()
    prompt = asked.pop("prompt")
    alone = generate(model, prompt, ClipRequest(**asked), Runner(solver=heun))

    def here():
        def send(packed):
            send_weights(model, weight_names(model, [PATCHED]), CPU)

        runner = Runner(
            solver=leading_solver(heun, CPU),
            ranks=RankGroup(softmax_ranks=1),
            check_cancel=shared_cancel(None),
            before_sampling=send,
        )
        return generate(model, prompt, ClipRequest(**asked), runner)

    job = ClipOnRanks(source, prompt, ClipRequest(**asked), softmax_ranks=1, follow=True)
    with RankWorkers(1) as workers:
        shared = workers.run(job, here=here)
    for a, b in zip(shared, alone):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-5


def stopping_job(rank, device, state):
    """Rank 0's solver raises in its progress after one evaluation; each evaluation meets the others in a
    collective, as a DiT's does."""

    def denoised(x, sigma):
        total = x.clone()
        torch.distributed.all_reduce(total)
        return total / 2

    def solver(denoised, x, sigmas, on_step):
        for i in range(len(sigmas) - 1):
            x = denoised(x, sigmas[i : i + 1])
            on_step(i + 1, len(sigmas) - 1, x)
        return x

    def on_step(i, n, x):
        if i == 1:
            raise KeyboardInterrupt("stopped in rank 0's progress")

    x, sigmas = torch.ones(3), torch.linspace(1, 0, 4)
    if rank == 0:
        return leading_solver(solver, device)(denoised, x, sigmas, on_step)
    try:
        following_solver(device)(denoised, x, sigmas, None)
    except RanksCancelled:
        state["stopped"] = True
        raise
    raise AssertionError("the follower went on")


def done_job(rank, device, state):
    x = torch.full((2,), float(rank))
    if rank == 0:
        return leading_solver(lambda d, x, s, o: d(x, s[:1]) + 1, device)(lambda x, s: x, x, torch.ones(2), None)
    final = following_solver(device)(lambda x, s: x, x, torch.ones(2), None)
    if not torch.equal(final, torch.ones(2)):
        raise AssertionError(f"the follower ended at {final}, not at rank 0's state")


def kitchen_job(rank, device, state):
    model = torch.nn.Sequential(kitchen_layer(seed=rank))
    if rank == 0:
        return send_weights(model, weight_names(model, ["0.weight"]), device)
    want = kitchen_layer(seed=0).weight.dequantize()
    if torch.equal(model[0].weight.dequantize(), want):
        raise AssertionError("the worker's weight was rank 0's before it was sent")
    if receive_weights(model, device) != ["0.weight"] or not torch.equal(model[0].weight.dequantize(), want):
        raise AssertionError("the worker's weight is not rank 0's after it was sent")


def kitchen_layer(seed):
    import comfy_kitchen.tensor as ck

    g = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(16, 8, bias=False)
    weight = ck.QuantizedTensor.from_float(torch.randn(8, 16, generator=g), "TensorWiseINT8Layout")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


def test_a_leader_stopping_between_evaluations_stops_the_followers_and_the_end_carries_its_state():
    with RankWorkers(1) as workers:
        with pytest.raises(KeyboardInterrupt, match="rank 0's progress"):
            workers.run(stopping_job)
        assert torch.equal(workers.run(done_job), torch.ones(2))  # in step again: the next job runs
        # the int8 codes (8 x 16 bytes) and the per-tensor scale (4 bytes)
        assert workers.run(kitchen_job) == 8 * 16 + 4
