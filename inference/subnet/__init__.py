"""Subnetwork GGN linearised-Laplace posteriors (FedSI), with a fast subnet-only Jacobian path.

Quick tour::

    from inference.subnet import select_subnet, fit_subnet_laplace

    idx = select_subnet(model, loader, size=800, prior_precision=1 / g)   # CPU int64, sorted
    post = fit_subnet_laplace(model, loader, idx, prior_precision=1 / g)
    post.marginal_std_full()            # (P,) zeros outside the subnet: FedSI's upload
    post.predict_proba(x)               # GLM predictive, probit link (default)
    post.sample(10)                     # (10, P) full parameter vectors

Index space everywhere: the flattened trainable parameters (``requires_grad=True``) in
``model.parameters()`` order, as laplace-torch's ``subnetwork_indices``.
"""

from inference.subnet.diagonal import diagonal_ggn
from inference.subnet.diagonal_posterior import DiagonalLaplacePosterior, fit_diagonal_laplace
from inference.subnet.fit import fit_subnet_laplace, subnet_ggn
from inference.subnet.jacobian import SubnetJacobian
from inference.subnet.memory import available_memory_bytes, check_memory
from inference.subnet.parameters import flat_trainable_parameters
from inference.subnet.posterior import SubnetLaplacePosterior
from inference.subnet.selection import rank_by_variance, select_subnet

__all__ = [
    "DiagonalLaplacePosterior",
    "SubnetJacobian",
    "SubnetLaplacePosterior",
    "available_memory_bytes",
    "check_memory",
    "diagonal_ggn",
    "fit_diagonal_laplace",
    "fit_subnet_laplace",
    "flat_trainable_parameters",
    "rank_by_variance",
    "select_subnet",
    "subnet_ggn",
]
