"""A solver that only rank 0 can run (the host's samplers live in its process) across ranks: rank 0's solver
integrates, and before each of its evaluations tells the other ranks the state and σ; they evaluate the same
``denoised(x, σ)`` (its collectives meet rank 0's) and keep no state of their own. Every rank runs ``generate``
with the same request, rank 0 with ``leading_solver(solver)``, the others with ``following_solver()``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .exchange import first_rank
from .workers import RanksCancelled

__all__ = ["leading_solver", "following_solver"]

_EVALUATE, _DONE, _STOPPED = 0.0, 1.0, 2.0


def _tell(code: float, sigma: float, device, group) -> None:
    order = torch.tensor([code, sigma], dtype=torch.float64, device=device)
    dist.broadcast(order, first_rank(group), group=group)


def leading_solver(solver, device, group=None):
    """``solver`` (``sampler.Solver``) on rank 0 of ``group``, telling the following ranks each evaluation, the end
    (with the final state) or that it stopped. A failure inside an evaluation is not told: the other ranks are in
    that evaluation's collectives with it (a shared cancel stops them all; anything else leaves them waiting, for
    ``RankWorkers.run`` to close)."""

    def solve(denoised, x, sigmas, on_step):
        inside = False

        def told(state, sigma):
            nonlocal inside
            _tell(_EVALUATE, float(torch.as_tensor(sigma).flatten()[0]), device, group)
            dist.broadcast(state.to(device).contiguous(), first_rank(group), group=group)
            inside = True
            result = denoised(state, sigma)
            inside = False
            return result

        try:
            final = solver(told, x, sigmas, on_step)
        except BaseException:
            if not inside:
                _tell(_STOPPED, 0.0, device, group)
            raise
        _tell(_DONE, 0.0, device, group)
        dist.broadcast(final.to(device).contiguous(), first_rank(group), group=group)
        return final

    return solve


def following_solver(device, group=None):
    """The solver of a rank beside rank 0's ``leading_solver``: each evaluation at the state and σ rank 0 tells;
    returns rank 0's final state; raises ``RanksCancelled`` when rank 0 stopped."""

    def solve(denoised, x, sigmas, on_step):
        state = torch.empty_like(x, device=device)
        order = torch.empty(2, dtype=torch.float64, device=device)
        while True:
            dist.broadcast(order, first_rank(group), group=group)
            code, sigma = order.tolist()
            if code == _STOPPED:
                raise RanksCancelled("rank 0's sampler stopped")
            dist.broadcast(state, first_rank(group), group=group)
            if code == _DONE:
                return state.to(x.device)
            denoised(state.to(x.device), torch.tensor([sigma], dtype=torch.float64))

    return solve
