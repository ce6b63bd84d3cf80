"""Per-sample Jacobians of the logits w.r.t. the subnet entries only.

laplace-torch builds the Jacobian of **all** parameters (B, C, P) and slices it to the subnet,
both when fitting and in every predictive call. Here the Jacobian is built column-block by
column-block from what each layer needs:

* ``nn.Linear`` / ``nn.Conv2d`` parameters (the fast path): one forward pass with activation
  capture and C output-space VJPs w.r.t. the captured layer outputs; the subnet columns are
  then products of an output-gradient row and an input column, ``J[b, o, (i, j)] =
  g[o, b, i] * a[b, j]`` (summed over positions for a convolution). Cost O(B C |S|) on top of
  C backward passes; the (B, C, P) Jacobian never exists.
* any other parameter tensor holding subnet entries (normalisation layers, custom or tied
  parameters): ``torch.func`` ``vmap(jacrev)`` w.r.t. those tensors only, the rest closed over,
  then a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import functional_call

from inference.errors import InvalidInputError
from inference.subnet.batches import check_logits
from inference.subnet.capture import (
    ActivationCapture,
    conv2d_unfold,
    functional_parameters,
    generic_jacobians,
    output_vjps,
)
from inference.subnet.parameters import ParameterSlot, trainable_slots

__all__ = ["SubnetJacobian"]


@dataclass
class _FastGroup:
    """Subnet entries held by the weight or the bias of one Linear / Conv2d layer."""

    slot: ParameterSlot
    rows: Tensor  # output unit / channel of each entry, (n,) on device
    cols: Tensor  # input feature / unfolded (C_in, kh, kw) index of each entry; empty for bias
    local: Tensor  # flat index inside the parameter tensor, (n,)
    positions: Tensor  # column of each entry in the subnet Jacobian, (n,)


@dataclass
class _GenericGroup:
    slot: ParameterSlot
    local: Tensor
    positions: Tensor


class SubnetJacobian:
    """Callable computing ``(J_S, logits)`` for a batch, linearised at a flat parameter vector.

    Args:
        model: the network; it must return (B, C) logits and treat samples independently
            (it is evaluated as it is: call it in eval mode).
        subnet_indices: (S,) CPU int64 indices into the trainable-parameter vector (see
            :mod:`inference.subnet.parameters`); the column order of ``J_S`` follows them.
        mean: (P,) flat trainable-parameter vector at which to linearise, on the model's device.
    """

    def __init__(self, model: nn.Module, subnet_indices: Tensor, mean: Tensor) -> None:
        self.model = model
        self.slots = trainable_slots(model)
        n_params = sum(s.numel for s in self.slots)
        if mean.dim() != 1 or mean.numel() != n_params:
            raise InvalidInputError(
                f"mean must be a flat vector of the {n_params} trainable parameters, "
                f"got shape {tuple(mean.shape)}"
            )
        self.mean = mean
        self.n_subnet = subnet_indices.numel()
        device = mean.device
        offsets = torch.tensor([s.offset for s in self.slots], dtype=torch.int64)
        owner = torch.searchsorted(offsets, subnet_indices, right=True) - 1
        self.fast: list[_FastGroup] = []
        self.generic: list[_GenericGroup] = []
        for k, slot in enumerate(self.slots):
            positions = torch.nonzero(owner == k).flatten()
            if positions.numel() == 0:
                continue
            local = subnet_indices[positions] - slot.offset
            if slot.module is None:
                self.generic.append(_GenericGroup(slot, local.to(device), positions.to(device)))
                continue
            if slot.role == "weight":
                per_row = slot.param[0].numel()  # in_features or C_in * kh * kw
                rows, cols = local // per_row, local % per_row
            else:
                rows, cols = local, local[:0]
            self.fast.append(
                _FastGroup(
                    slot,
                    rows.to(device),
                    cols.to(device),
                    local.to(device),
                    positions.to(device),
                )
            )
        # Blocks are concatenated group by group (fast groups first); when that is not already
        # the order of ``subnet_indices`` (e.g. unsorted indices), one column gather restores it.
        concat_positions = torch.cat([g.positions for g in self.fast + self.generic]).cpu()
        if torch.equal(concat_positions, torch.arange(self.n_subnet)):
            self._column_order = None
        else:
            self._column_order = torch.argsort(concat_positions).to(device)
        self._fast_names = {g.slot.name for g in self.fast}
        self._generic_names = [g.slot.name for g in self.generic]
        self._modules = [g.slot.module for g in self.fast]

    def logits(self, x: Tensor) -> Tensor:
        """(B, C) logits at ``mean``, without any Jacobian."""
        params = functional_parameters(self.slots, self.mean, set())
        with torch.no_grad():
            return check_logits(functional_call(self.model, params, (x,)), x.shape[0])

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Jacobian of the logits w.r.t. the subnet at ``mean``.

        Args:
            x: (B, ...) inputs on the model's device.

        Returns:
            ``J``: (C, B, S), ``J[o, b, s] = d logits[b, o] / d theta[subnet_indices[s]]``
            (output-major so that ``J.reshape(C * B, S)`` is a plain matrix);
            ``logits``: (B, C) at ``mean``, detached.
        """
        params = functional_parameters(self.slots, self.mean, self._fast_names)
        with torch.enable_grad(), ActivationCapture(self._modules) as capture:
            logits = functional_call(self.model, params, (x,))
        logits = check_logits(logits, x.shape[0])
        C, B = logits.shape[1], logits.shape[0]
        blocks: list[Tensor] = []
        if self.fast:
            basis = torch.eye(C, dtype=logits.dtype, device=logits.device)
            grad_outputs = basis.unsqueeze(1).expand(C, B, C)
            grads = output_vjps(logits, capture.outputs(), grad_outputs)
            by_output = dict(zip([id(o) for o in capture.outputs()], grads, strict=True))
            for group in self.fast:
                block = None
                for inputs, out in capture.records[id(group.slot.module)]:
                    part = _fast_block(group, inputs.detach(), by_output[id(out)])
                    block = part if block is None else block + part
                blocks.append(block.to(logits.dtype))
        if self.generic:
            jac = generic_jacobians(self.model, params, self._generic_names, x)
            for group in self.generic:
                cols = jac[group.slot.name].reshape(B, C, -1).index_select(2, group.local)
                blocks.append(cols.transpose(0, 1).to(logits.dtype))
        J = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)
        if self._column_order is not None:  # groups concatenated -> the caller's index order
            J = J.index_select(2, self._column_order)
        return J, logits.detach()


def _fast_block(group: _FastGroup, inputs: Tensor, grad: Tensor) -> Tensor:
    """Subnet columns of one layer call: (K, B, n) from its input and output-gradients (K, B, ...)."""
    module = group.slot.module
    K, B = grad.shape[0], grad.shape[1]
    if isinstance(module, nn.Linear):
        g = grad.reshape(K, B, -1, module.out_features)  # (K, B, T, out); T = 1 for 2-D input
        if group.slot.role == "bias":
            return g.index_select(3, group.rows).sum(2)
        a = inputs.reshape(B, -1, module.in_features)
        if a.shape[1] == 1:
            return g[:, :, 0].index_select(2, group.rows) * a[:, 0].index_select(1, group.cols)
        return (g.index_select(3, group.rows) * a.index_select(2, group.cols)).sum(2)
    # nn.Conv2d, groups == 1
    g = grad.reshape(K, B, module.out_channels, -1)  # (K, B, C_out, L)
    if group.slot.role == "bias":
        return g.sum(-1).index_select(2, group.rows)
    U = conv2d_unfold(module, inputs)  # (B, C_in * kh * kw, L)
    n, L = group.rows.numel(), U.shape[-1]
    if n * L <= module.weight.numel():  # gather then dot over positions
        return (g.index_select(2, group.rows) * U.index_select(1, group.cols)).sum(-1)
    per_sample = torch.einsum("kbcl,bjl->kbcj", g, U).reshape(K, B, -1)  # this layer only
    return per_sample.index_select(2, group.local)
