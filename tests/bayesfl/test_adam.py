"""bayesfl.adam.Adam is torch.optim.Adam's update bit for bit, without importing torch._dynamo."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bayesfl.adam import Adam
from bayesfl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _parameters(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,), ()]  # matrices, vectors, 3-d, a single and a 0-d
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _loss(params: list[torch.Tensor], step: int) -> torch.Tensor:
    # a non-quadratic loss whose gradients change scale from step to step and over entries
    return sum(((p * (k + 1 + step)).sin() ** 2 * (1 + p.abs())).sum()
               for k, p in enumerate(params))


def _run(optimizer_of, params, steps: int, skip: int | None = None) -> None:
    optimizer = optimizer_of(params)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        _loss(params, step).backward()
        if skip is not None and step % 2:
            params[skip].grad = None  # this parameter takes no step now, as in torch
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("options", [
    {},
    {"lr": 3e-2, "betas": (0.8, 0.99), "eps": 1e-6},
    {"lr": 1e-2, "weight_decay": 0.1},
    {"lr": 1e-2, "weight_decay": 1e-3, "amsgrad": True},
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parameters_and_state_equal_torch_optim_adam_bit_for_bit(options, dtype):
    ours, theirs = _parameters(0, dtype), _parameters(0, dtype)
    opt = _run(lambda ps: Adam(ps, **options), ours, steps=12, skip=2)
    ref = _run(lambda ps: torch.optim.Adam(ps, foreach=False, **options), theirs, steps=12,
               skip=2)
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        # bit for bit: the same operations in the same order round the same way, so any
        # difference, even one ulp, means the formula or its order differs
        assert torch.equal(a, b), f"parameter {k}: max diff {(a - b).abs().max()}"
        mine, ref_state = opt.state[a], ref.state[b]
        assert set(mine) == set(ref_state)
        for key in ref_state:
            assert mine[key].dtype == ref_state[key].dtype, key
            assert mine[key].device == ref_state[key].device, key
            assert torch.equal(mine[key], ref_state[key]), f"parameter {k} {key}"


def test_a_parameter_that_never_had_a_gradient_has_no_state_and_is_unchanged():
    params = _parameters(1)
    frozen = params[0].detach().clone()
    opt = Adam(params, lr=0.1)
    for step in range(3):
        opt.zero_grad()
        _loss(params[1:], step).backward()
        opt.step()
    assert params[0] not in opt.state
    assert torch.equal(params[0].detach(), frozen)


def test_moments_seeded_into_state_resume_as_in_torch():
    # personal strategies keep Adam's moments across rounds by writing optimizer.state[p]
    ours, theirs = _parameters(2), _parameters(2)
    _run(lambda ps: Adam(ps, lr=1e-2), ours, steps=3)
    first = _run(lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False), theirs, steps=3)
    seeded = {id(b): {k: v.clone() for k, v in first.state[b].items()} for b in theirs}
    opt, ref = Adam(ours, lr=1e-2), torch.optim.Adam(theirs, lr=1e-2, foreach=False)
    for a, b in zip(ours, theirs, strict=True):
        opt.state[a] = {k: v.clone() for k, v in seeded[id(b)].items()}
        ref.state[b] = {k: v.clone() for k, v in seeded[id(b)].items()}
    for step in range(3, 6):
        for o, ps in ((opt, ours), (ref, theirs)):
            o.zero_grad()
            _loss(ps, step).backward()
            o.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["step"], ref.state[b]["step"])


def test_zero_grad_without_set_to_none_zeroes_the_gradients():
    params = _parameters(3)
    opt = Adam(params)
    _loss(params, 0).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("options", [{"lr": -1.0}, {"betas": (0.9, 1.0)}, {"eps": -1e-8},
                                     {"weight_decay": -0.1}])
def test_bad_hyperparameters_are_config_errors(options):
    with pytest.raises(ConfigError):
        Adam(_parameters(4), **options)


def test_a_training_step_in_a_fresh_process_does_not_import_torch_dynamo():
    # torch.optim imports torch._dynamo (and sympy) on an optimizer's first use: seconds in
    # every fresh Flower ClientApp process; bayesfl's training must not
    code = textwrap.dedent("""
        import sys
        import torch
        from torch import nn
        from bayesfl.training import LocalTraining, train_plain
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        x, y = torch.randn(20, 4), torch.randint(0, 3, (20,))
        ce = lambda out, y: nn.functional.cross_entropy(out, y, reduction="none")
        train_plain(model, x, y, ce, LocalTraining(epochs=2, batch_size=5),
                    generator=torch.Generator().manual_seed(0))
        print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---- StackedAdam: many clients' parameters on a leading axis, stepping together ------------
def laid_out(grads: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """``grads`` with the same values, each matrix laid out as ``layout`` says: "contiguous",
    or "transposed" per client (as a vmapped linear layer's weight gradient comes)."""
    if layout == "contiguous":
        return grads
    out = {n: g.transpose(-1, -2).contiguous().transpose(-1, -2) if g.dim() > 2 else g
           for n, g in grads.items()}
    assert not out["w"].is_contiguous() and torch.equal(out["w"], grads["w"])
    return out


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("lr", [1e-3, 0.3])
def test_stacked_adam_equals_each_clients_own_adam_bit_for_bit(lr, layout):
    # every operation of the update is elementwise with coefficients that depend only on the
    # shared step count, so each client's rows go through exactly its own Adam's arithmetic:
    # equal with torch.equal, not just close (Adam itself equals torch.optim.Adam, above).
    # 5 clients; the (300, 1000) parameter spans several of the update's ~256 KiB slices
    # (65,536 elements, so 1 client a slice) and the others fit in one.
    from bayesfl.adam import StackedAdam
    k, shapes = 5, {"w": (300, 1000), "b": (7,), "m": (3, 4, 2), "s": ()}
    g = torch.Generator().manual_seed(0)
    stacked = {n: torch.randn((k, *s), generator=g) for n, s in shapes.items()}
    clients = [{n: v[c].clone() for n, v in stacked.items()} for c in range(k)]
    own = [Adam(list(p.values()), lr=lr) for p in clients]
    together = StackedAdam.zeros(stacked)
    for step in range(4):  # gradients of a different scale per client and per step
        grads = {n: torch.randn((k, *s), generator=g) * 10.0 ** torch.arange(-2, k - 2).view(
            (k,) + (1,) * len(s)) * (step + 1) for n, s in shapes.items()}
        together.step(stacked, laid_out(grads, layout), lr=lr, b1=0.9, b2=0.999, eps=1e-8)
        for c, (params, optimizer) in enumerate(zip(clients, own, strict=True)):
            for n, p in params.items():
                p.grad = grads[n][c].clone()
            optimizer.step()
    assert together.steps == 4
    for c, (params, optimizer) in enumerate(zip(clients, own, strict=True)):
        for n, p in params.items():
            assert torch.equal(stacked[n][c], p), (c, n)
            assert torch.equal(together.m[n][c], optimizer.state[p]["exp_avg"]), (c, n)
            assert torch.equal(together.v[n][c], optimizer.state[p]["exp_avg_sq"]), (c, n)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("b1", [0.9, 0.3])
def test_a_fresh_stacked_adams_last_step_keeps_no_moments_and_equals_each_clients_adam(b1,
                                                                                        layout):
    # the batched trainer's step when a client group has one mini-batch per epoch: the update
    # runs on zeroed moments of one slice at a time, never on whole zeroed buffers; the same
    # arithmetic, so the same bits as each client's own first Adam step (torch.equal), zero
    # and negative-zero gradients included (b1 = 0.3 takes lerp's other branch)
    from bayesfl.adam import StackedAdam
    k, shapes = 5, {"w": (300, 1000), "b": (7,), "s": ()}
    g = torch.Generator().manual_seed(1)
    stacked = {n: torch.randn((k, *s), generator=g) for n, s in shapes.items()}
    grads = {n: torch.randn((k, *s), generator=g) for n, s in shapes.items()}
    grads["w"][0, 0, :3] = torch.tensor([0.0, -0.0, 1e-30])
    together = StackedAdam.zeros(stacked)
    for round in range(2):  # a reset state behaves as a fresh one
        start = {n: v.clone() for n, v in stacked.items()}
        together.step(stacked, laid_out(grads, layout), lr=1e-2, b1=b1, b2=0.999, eps=1e-8,
                      last=True)
        assert together.m == {} and together.v == {} and together.steps == 1
        for c in range(k):
            params = {n: v[c].clone() for n, v in start.items()}
            own = Adam(list(params.values()), lr=1e-2, betas=(b1, 0.999))
            for n, p in params.items():
                p.grad = grads[n][c].clone()
            own.step()
            for n, p in params.items():
                assert torch.equal(stacked[n][c], p), (round, c, n)
        with pytest.raises(ConfigError, match="last step"):  # its moments are gone
            together.step(stacked, grads, lr=1e-2, b1=b1, b2=0.999, eps=1e-8)
        together.reset()
    together.step(stacked, grads, lr=1e-2, b1=b1, b2=0.999, eps=1e-8)  # not the last: kept
    assert set(together.m) == set(shapes) and together.steps == 1


def test_a_batched_fedlog_round_in_a_fresh_process_does_not_import_torch_dynamo(tmp_path):
    # the batched trainer's Adam over stacked clients was torch.optim.Adam(fused=True), and
    # its gradients torch.func.grad: each imports torch._dynamo on first use (1.7 s on a quiet
    # machine, per simulator process). (sympy, which F.cross_entropy under vmap imported, has
    # its own test: test_training's fresh-process FedLog fit.)
    code = textwrap.dedent("""
        import sys
        from bayesfl.simulate import simulate
        result = simulate("fedlog", dataset="digits", clients=6, partition="iid", rounds=2,
                          seed=0, local_epochs=1, batched=True, progress=False)
        assert result.metrics[-1]["round"] == 2
        print("torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout
