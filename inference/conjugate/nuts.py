"""NUTS (pyro-ppl) on the exact unnormalised conjugate log posterior.

The sampler runs in whitened coordinates ``z`` with ``W = W* + L z``, where ``L`` is the
Laplace factor (`inference.conjugate.laplace.ConjugateLaplace`). This is a linear change
of variables with a constant Jacobian, so the target is still exactly the posterior
``exp(J(W))`` — but its scales and correlations are close to those of a standard normal, so the
step size adapts quickly and trees stay shallow whatever the size of ``N``.

pyro draws from torch's global generator; when a ``generator`` is given, a seed drawn from it
seeds a forked global state, so runs are reproducible and the caller's global state is untouched.
The chain runs on the CPU in float64 (small dimensions; GPU kernel launches would dominate).
"""

from __future__ import annotations

import torch
from torch import Tensor

from inference.conjugate.laplace import ConjugateLaplace
from inference.conjugate.solver import map_objective
from inference.errors import InvalidInputError, NumericalError


def sample_nuts(
    laplace: ConjugateLaplace,
    S: Tensor,
    N: float,
    num_samples: int,
    warmup_steps: int | None = None,
    generator: torch.Generator | None = None,
    max_tree_depth: int = 8,
) -> Tensor:
    """Draw ``num_samples`` heads from ``p(W) ∝ exp(<W, S> - N logsumexp(||W_y||^2/4))``.

    Args:
        laplace: Laplace approximation at the MAP (gives the start and the whitening).
        S: natural statistic ``(C, k)``; N: natural count.
        num_samples: draws kept after warm-up (>= 1).
        warmup_steps: adaptation steps (default ``max(100, num_samples // 2)``).
        generator: seeds the chain (see module docstring).
        max_tree_depth: NUTS tree-depth cap: at most ``2 ** max_tree_depth`` leapfrog steps
            per draw (an integer >= 1).

    Returns:
        Draws of shape ``(num_samples, C, k)``, float64, on ``laplace.mean``'s device.
    """
    from pyro.infer.mcmc import MCMC, NUTS  # heavy import, only when sampling

    if num_samples < 1:
        raise InvalidInputError(f"num_samples must be >= 1, got {num_samples}")
    if isinstance(max_tree_depth, bool) or not isinstance(max_tree_depth, int) \
            or max_tree_depth < 1:
        raise InvalidInputError(f"max_tree_depth must be an integer >= 1, got {max_tree_depth!r}")
    warmup = max(100, num_samples // 2) if warmup_steps is None else int(warmup_steps)
    device = laplace.mean.device
    cpu_laplace = laplace.to("cpu")
    S_cpu = S.to("cpu", torch.float64)

    def potential(params: dict[str, Tensor]) -> Tensor:
        W = cpu_laplace.mean + cpu_laplace.factor_matvec(params["z"])
        return -map_objective(W, S_cpu, N)

    seed = None
    if generator is not None:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        kernel = NUTS(potential_fn=potential, adapt_mass_matrix=True, max_tree_depth=max_tree_depth)
        mcmc = MCMC(
            kernel, num_samples=num_samples, warmup_steps=warmup,
            initial_params={"z": torch.zeros(laplace.shape, dtype=torch.float64)},
            disable_progbar=True,
        )
        mcmc.run()
    z = mcmc.get_samples()["z"]
    draws = cpu_laplace.mean + cpu_laplace.factor_matvec(z)
    if not bool(torch.isfinite(draws).all()):
        raise NumericalError(
            f"NUTS produced non-finite draws ({int((~torch.isfinite(draws)).sum())} of "
            f"{draws.numel()} numbers). Give it more adaptation (warmup_steps=, now {warmup}) "
            f"or a longer trajectory per draw (max_tree_depth=, now {max_tree_depth}: at most "
            "2**depth leapfrog steps), both arguments of sample(..., method='nuts'); or draw "
            "with method='laplace', which needs no adaptation"
        )
    return draws.to(device)
