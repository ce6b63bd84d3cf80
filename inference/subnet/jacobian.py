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

from collections.abc import Callable
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



MAX_UNIT_RUNS = 4096
"""More runs of one unit than this and the factored paths are not used."""


@dataclass(frozen=True)
class UnitRuns:
    """Subnet positions grouped by the output unit they feed.

    runs: ``(start, end, u)`` per maximal run of consecutive positions of one unit, ``u`` its
        compact id; present: (U,) the units that occur (ids of `SubnetJacobian.units`),
        on the engine's device; compact: (S,) the compact id of every position, same device.
    """

    runs: list[tuple[int, int, int]]
    present: Tensor
    compact: Tensor

class SubnetJacobian:
    """Callable computing ``(J_S, logits)`` for a batch, linearised at a flat parameter vector.

    Args:
        model: the network; it must return (B, C) logits and treat samples independently
            (it is evaluated as it is: call it in eval mode).
        subnet_indices: (S,) CPU int64 indices into the trainable-parameter vector (see
            `inference.subnet.parameters`); the column order of ``J_S`` follows them.
        mean: (P,) flat trainable-parameter vector at which to linearise, on the model's device.
    """

    def __init__(self, model: nn.Module, subnet_indices: Tensor, mean: Tensor) -> None:
        self.model = model
        self._unit_runs: UnitRuns | bool | None = False  # False: not computed yet
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

    def workspace_bytes(self, rows: int, n_vectors: int) -> dict[str, int]:
        """Upper bounds of the largest temporaries of one call on ``rows`` inputs, by name.

        ``n_vectors`` is K, the number of output-space vectors (C for the plain Jacobian).
        """
        itemsize = self.mean.element_size()
        plan = {
            "subnet Jacobian chunk (S x K x rows) and a gathered copy": 2
            * self.n_subnet
            * n_vectors
            * rows
            * itemsize
        }
        n_generic = sum(g.slot.numel for g in self.generic)
        if n_generic:
            plan["per-sample Jacobian of parameters outside Linear/Conv2d (rows x C x n)"] = (
                rows * n_vectors * n_generic * itemsize
            )
        n_conv = sum(g.slot.numel for g in self.fast if isinstance(g.slot.module, nn.Conv2d))
        if n_conv:
            plan["per-sample Conv2d weight gradients (K x rows x n)"] = (
                n_vectors * rows * n_conv * itemsize
            )
        return plan

    @property
    def factorable(self) -> bool:
        """Whether `linear_factors` applies: every subnet entry sits in an ``nn.Linear``
        weight or bias (no Conv2d, no generic parameter)."""
        return not self.generic and all(isinstance(g.slot.module, nn.Linear) for g in self.fast)

    def units(self) -> tuple[Tensor, int]:
        """``(unit (S,) int64, U)``: the output unit of its layer each subnet entry feeds, as
        one id over all subnet layers (weight and bias entries of one unit share it); layers
        are numbered in the order `linear_factors` stacks their gradients."""
        modules = list({id(g.slot.module): g.slot.module for g in self.fast}.values())
        offset, total = {}, 0
        for module in modules:
            offset[id(module)] = total
            total += module.out_features
        unit = torch.empty(self.n_subnet, dtype=torch.int64, device=self.mean.device)
        for g in self.fast:
            unit[g.positions] = offset[id(g.slot.module)] + g.rows
        return unit, total

    def unit_runs(self) -> UnitRuns | None:
        """Maximal runs of consecutive subnet positions feeding one output unit (computed once);
        None when there are more than ``MAX_UNIT_RUNS`` (e.g. unsorted indices), where the
        factored GGN and predictive would loop too long."""
        if self._unit_runs is False:
            unit, _ = self.units()
            present, compact = torch.unique(unit.cpu(), return_inverse=True)
            breaks = (torch.nonzero(compact[1:] != compact[:-1]).flatten() + 1).tolist()
            starts, ends = [0, *breaks], [*breaks, compact.numel()]
            self._unit_runs = None
            if len(starts) <= MAX_UNIT_RUNS:
                runs = [(a, e, int(compact[a])) for a, e in zip(starts, ends, strict=True)]
                device = self.mean.device
                self._unit_runs = UnitRuns(runs, present.to(device), compact.to(device))
        return self._unit_runs

    def unit_factors(
        self, x: Tensor, output_vectors: Callable | None = None
    ) -> tuple[Tensor, Tensor, Tensor, UnitRuns] | None:
        """`linear_factors` with ``G`` kept to the units the subnet feeds, and their runs:
        ``(A (B, S), G (K, B, U), logits (B, C), unit_runs())``, U the units present; None
        where the factorisation or the runs do not apply (the factored GGN, predictive and
        low-rank posterior fall back to their dense routes)."""
        plan = self.unit_runs() if self.factorable else None
        if plan is None:
            return None
        factors = self.linear_factors(x, output_vectors)
        if factors is None:
            return None
        A, G, logits = factors
        return A, G.index_select(2, plan.present), logits, plan

    def linear_factors(
        self, x: Tensor, output_vectors: Callable | None = None
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """The factorisation ``J[b, o, s] = G[o, b, unit[s]] * A[b, s]`` of the subnet Jacobian
        when every entry is in a Linear layer called once on a 2-D input (else None).

        For a weight entry (h, j) of a Linear layer, ``A[b, s]`` is the layer's input j and
        ``G[o, b, h]`` the derivative of logit o w.r.t. the layer's output h; for a bias entry
        ``A = 1``. Computing ``G`` takes the same C vector-Jacobian products as the Jacobian.

        ``output_vectors`` maps the detached logits to K output-space vectors (K, B, C) as in
        `__call__`; ``G`` then holds ``v_k^T d logits / d output`` instead of one row per
        logit.

        Returns:
            ``(A (B, S), G (K, B, U), logits (B, C))``, K = C by default, units as in
            `units`; None when the factorisation does not apply. ``A`` is the transposed view
            of a contiguous (S, B) tensor (``A.T`` is contiguous: an entry's B values in one
            row).
        """
        if not self.factorable:
            return None
        params = functional_parameters(self.slots, self.mean, self._fast_names)
        with torch.enable_grad(), ActivationCapture(self._modules) as capture:
            logits = functional_call(self.model, params, (x,))
        logits = check_logits(logits, x.shape[0])
        B, C = logits.shape
        modules = {id(g.slot.module): g.slot.module for g in self.fast}
        calls = {key: capture.records[key] for key in modules}
        if any(len(c) != 1 or c[0][0].reshape(B, -1).shape[1] != m.in_features
               for key, c in calls.items() for m in [modules[key]]):
            return None  # a layer called twice, never, or on (B, T, in) inputs
        if output_vectors is None:
            basis = torch.eye(C, dtype=logits.dtype, device=logits.device)
            vectors = basis.unsqueeze(1).expand(C, B, C)
        else:
            vectors = output_vectors(logits.detach())
        outputs = [calls[key][0][1] for key in modules]
        grads = output_vjps(logits, outputs, vectors)
        K = vectors.shape[0]
        G = torch.cat([g.reshape(K, B, -1) for g in grads], dim=2).to(logits.dtype)
        # A^T (S, B) built row by row: gathers and writes of contiguous rows (along the last
        # axis of A they were 10 of the 12 ms of an S1 upload's factors; issue 41)
        At = logits.new_empty(self.n_subnet, B)
        for g in self.fast:
            if g.slot.role == "weight":
                inputs = calls[id(g.slot.module)][0][0].detach().reshape(B, -1)
                rows = inputs.T.contiguous().index_select(0, g.cols).to(logits.dtype)
                At.index_copy_(0, g.positions, rows)
            else:
                At.index_fill_(0, g.positions, 1.0)
        return At.T, G, logits.detach()

    def logits(self, x: Tensor) -> Tensor:
        """(B, C) logits at ``mean``, without any Jacobian."""
        params = functional_parameters(self.slots, self.mean, set())
        with torch.no_grad():
            return check_logits(functional_call(self.model, params, (x,)), x.shape[0])

    def __call__(
        self, x: Tensor, column_scale: Tensor | None = None, output_vectors: Callable | None = None
    ) -> tuple[Tensor, Tensor]:
        """Transposed Jacobian of the logits w.r.t. the subnet at ``mean``.

        Args:
            x: (B, ...) inputs on the model's device.
            column_scale: optional (S,) factors multiplied into the subnet columns (cheaper
                here, on the small per-layer factors, than on the result).
            output_vectors: optional map from the detached (B, C) logits to K output-space
                vectors per sample, (K, B, C); the result is then ``J^T v`` for each of them
                instead of ``J^T e_o`` (e.g. the columns of a square root of the softmax
                Hessian, which turns the GGN into one Gram matrix).

        Returns:
            ``Jt``: (S, K, B) with K = C by default, ``Jt[s, o, b] = d logits[b, o] /
            d theta[subnet_indices[s]]``, subnet-major so that ``Jt.reshape(S, K * B)`` is a
            contiguous matrix and every gather runs along the leading axis; ``logits``:
            (B, C) at ``mean``, detached.
        """
        params = functional_parameters(self.slots, self.mean, self._fast_names)
        with torch.enable_grad(), ActivationCapture(self._modules) as capture:
            logits = functional_call(self.model, params, (x,))
        logits = check_logits(logits, x.shape[0])
        B, C = logits.shape
        blocks: list[Tensor] = []
        if output_vectors is None:
            basis = torch.eye(C, dtype=logits.dtype, device=logits.device)
            vectors = basis.unsqueeze(1).expand(C, B, C)
        else:
            vectors = output_vectors(logits.detach())
        if self.fast:
            grads = output_vjps(logits, capture.outputs(), vectors)
            by_output = dict(zip([id(o) for o in capture.outputs()], grads, strict=True))
            for group in self.fast:
                scale = None if column_scale is None else column_scale[group.positions]
                block = None  # summed over the calls of the layer
                for inputs, out in capture.records[id(group.slot.module)]:
                    part = _fast_block(group, inputs.detach(), by_output[id(out)], scale)
                    block = part if block is None else block + part
                if block is None:  # the forward pass never calls this layer: zero columns
                    block = logits.new_zeros(group.positions.numel(), vectors.shape[0], B)
                blocks.append(block.to(logits.dtype))
        if self.generic:
            jac = generic_jacobians(self.model, params, self._generic_names, x)
            for group in self.generic:
                per_param = jac[group.slot.name].reshape(B, C, -1).index_select(2, group.local)
                block = torch.einsum("kbc,bcs->skb", vectors, per_param)
                if column_scale is not None:
                    block = block * column_scale[group.positions].view(-1, 1, 1)
                blocks.append(block.to(logits.dtype))
        Jt = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=0)
        if self._column_order is not None:  # groups concatenated -> the caller's index order
            Jt = Jt.index_select(0, self._column_order)
        return Jt, logits.detach()


def _fast_block(group: _FastGroup, inputs: Tensor, grad: Tensor, scale: Tensor | None) -> Tensor:
    """Subnet rows of ``Jt`` for one layer call, (n, K, B), from its input and output-gradients.

    ``grad`` (K, B, ...) holds the K output-space VJPs w.r.t. the layer output. The gathers
    run along the leading axis of contiguous tensors (fast), never along a strided last axis.
    """
    module = group.slot.module
    K, B = grad.shape[0], grad.shape[1]
    if isinstance(module, nn.Linear):
        # (out, K, B, T); T = 1 for a 2-D input
        gT = grad.reshape(K, B, -1, module.out_features).permute(3, 0, 1, 2).contiguous()
        if group.slot.role == "bias":
            block = gT.index_select(0, group.rows).sum(-1)
            return block if scale is None else block * scale.view(-1, 1, 1)
        aT = inputs.reshape(B, -1, module.in_features).permute(2, 0, 1).contiguous()  # (in,B,T)
        a_sel = aT.index_select(0, group.cols)  # (n, B, T)
        if scale is not None:
            a_sel = a_sel * scale.view(-1, 1, 1)
        if a_sel.shape[-1] == 1:
            return gT[..., 0].index_select(0, group.rows) * a_sel[:, None, :, 0]
        return (gT.index_select(0, group.rows) * a_sel[:, None]).sum(-1)
    # nn.Conv2d, groups == 1
    g = grad.reshape(K, B, module.out_channels, -1)  # (K, B, C_out, L)
    if group.slot.role == "bias":
        block = g.sum(-1).permute(2, 0, 1).contiguous().index_select(0, group.rows)
    else:
        U = conv2d_unfold(module, inputs)  # (B, C_in * kh * kw, L)
        n, L = group.rows.numel(), U.shape[-1]
        if n * L <= module.weight.numel():  # gather, then dot over output positions
            gT = g.permute(2, 0, 1, 3).contiguous()  # (C_out, K, B, L)
            UT = U.transpose(0, 1).contiguous()  # (C_in kh kw, B, L)
            block = (gT.index_select(0, group.rows) * UT.index_select(0, group.cols)[:, None]).sum(
                -1
            )
        else:  # per-sample gradients of this layer only, then gather
            per_sample = torch.einsum("kbcl,bjl->cjkb", g, U).reshape(-1, K, B)
            block = per_sample.index_select(0, group.local)
    return block if scale is None else block * scale.view(-1, 1, 1)
