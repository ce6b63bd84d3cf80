"""Local training: the batched (vmap) path equals the plain per-client loop."""

import copy
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from bayesfl.errors import ConfigError, LocalTrainingWarning
from bayesfl.training import (
    GaussianProx,
    LocalTraining,
    architecture_key,
    cross_entropy_per_sample,
    forward_stacked_tensors,
    pad_stack,
    train_batched,
    train_plain,
    train_stacked,
    watch_divergence,
)


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def _ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def _client_data(sizes):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 5, generator=g) for n in sizes]
    ys = [torch.randint(0, 3, (n,), generator=g) for n in sizes]
    return xs, ys


@pytest.mark.parametrize("reset", [True, False])
@pytest.mark.parametrize(
    "sizes",
    [[7, 23, 1, 12],  # different numbers of steps per epoch: masked Adam, idle clients
     [10, 9, 6]],  # the same number of steps, partial batches: StackedAdam over the stack
)
def test_batched_training_equals_plain_loop_with_unequal_client_sizes(reset, sizes):
    xs, ys = _client_data(sizes)
    config = LocalTraining(epochs=3, lr=1e-2, batch_size=5, reset_optimizer_each_epoch=reset)
    plain = [_mlp(k) for k in range(len(sizes))]
    batched = copy.deepcopy(plain)
    for k, model in enumerate(plain):
        g = torch.Generator().manual_seed(100 + k)
        train_plain(model, xs[k], ys[k], _ce, config, generator=g)
    gens = [torch.Generator().manual_seed(100 + k) for k in range(len(sizes))]
    train_batched(batched, xs, ys, _ce, config, generators=gens)
    for a, b in zip(plain, batched, strict=True):
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            # float32 rounding over 15 Adam steps; parameters are O(1)
            torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-5, msg=name)


_STOPPED = r"local training loss became (?:nan|inf) (at epoch \d of 3, mini-batch \d+)"


@pytest.mark.parametrize(
    "sizes",
    [[10, 9, 6],  # StackedAdam over the stack until the client stops, then the masked one
     [7, 23, 12]],  # masked Adam throughout
)
def test_a_client_whose_loss_becomes_non_finite_stops_there_and_the_others_train_on(sizes):
    xs, ys = _client_data(sizes)
    xs[1][4] = float("inf")  # one sample that makes the loss of its mini-batch non-finite
    config = LocalTraining(epochs=3, lr=1e-2, batch_size=5)
    plain = [_mlp(k) for k in range(3)]
    batched = copy.deepcopy(plain)
    with watch_divergence() as plain_stops:
        for k, model in enumerate(plain):
            train_plain(model, xs[k], ys[k], _ce, config,
                        generator=torch.Generator().manual_seed(100 + k))
    gens = [torch.Generator().manual_seed(100 + k) for k in range(3)]
    with watch_divergence() as batched_stops:
        train_batched(batched, xs, ys, _ce, config, generators=gens)
    assert list(batched_stops) == [id(gens[1])]  # the caller knows whose training stopped
    (plain_reason,), (batched_reason,) = plain_stops.values(), batched_stops.values()
    # both paths stop client 1 at the same mini-batch, before the step it would poison
    assert re.match(_STOPPED, plain_reason)[1] == re.match(_STOPPED, batched_reason)[1]
    assert "lower the learning rate (lr 0.01)" in batched_reason
    for a, b in zip(plain, batched, strict=True):
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert bool(torch.isfinite(pb).all()), name
            torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-5, msg=name)


def test_outside_a_watch_a_non_finite_loss_is_a_warning_and_the_model_is_left_as_it_was():
    xs, ys = _client_data([6])
    model = _mlp(0)
    before = copy.deepcopy(model)
    config = LocalTraining(epochs=1, lr=1e-2, batch_size=6)
    with pytest.warns(LocalTrainingWarning, match=r"loss became (nan|inf) at epoch 1 of 1, "
                                                  r"mini-batch 1, and training stopped there"):
        train_plain(model, xs[0] * float("inf"), ys[0], _ce, config,
                    generator=torch.Generator().manual_seed(0))
    for pa, pb in zip(model.parameters(), before.parameters(), strict=True):
        assert torch.equal(pa, pb) and pa.requires_grad


def test_frozen_parameters_are_untouched_in_both_paths():
    xs, ys = _client_data([9, 4])
    config = LocalTraining(epochs=2, lr=1e-2, batch_size=4)
    models = [_mlp(1), _mlp(2)]
    before = [copy.deepcopy(m) for m in models]
    only_first = lambda name: name.startswith("0.")  # noqa: E731
    gens = [torch.Generator().manual_seed(k) for k in range(2)]
    train_batched(models, xs, ys, _ce, config, generators=gens, trainable=only_first)
    train_plain(models[0], xs[0], ys[0], _ce, config, generator=gens[0], trainable=only_first)
    for m, b in zip(models, before, strict=True):
        assert torch.equal(m[2].weight, b[2].weight)
        assert not torch.equal(m[0].weight, b[0].weight)
        assert all(p.requires_grad for p in m.parameters())


@pytest.mark.trained
def test_training_reduces_the_loss():
    xs, ys = _client_data([40])
    model = _mlp(0)
    loss0 = _ce(model(xs[0]), ys[0]).mean().item()
    config = LocalTraining(epochs=30, lr=1e-2, batch_size=8)
    train_plain(model, xs[0], ys[0], _ce, config, generator=torch.Generator().manual_seed(0))
    assert _ce(model(xs[0]), ys[0]).mean().item() < 0.7 * loss0


def test_batched_training_refuses_mixed_architectures():
    other = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    assert architecture_key(_mlp(0)) != architecture_key(other)
    xs, ys = _client_data([3, 3])
    gens = [torch.Generator() for _ in range(2)]
    with pytest.raises(ConfigError, match="one architecture"):
        train_batched([_mlp(0), other], xs, ys, _ce, LocalTraining(), generators=gens)


def test_bad_hyperparameters_are_config_errors():
    with pytest.raises(ConfigError):
        LocalTraining(batch_size=0)
    with pytest.raises(ConfigError):
        LocalTraining(lr=0.0)


def _bn_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    model[1].running_mean.uniform_(-1, 1)  # buffers that matter in eval mode
    return model


@pytest.mark.parametrize("chunk", [2, 256])
def test_stacked_forward_equals_each_model_on_its_own_inputs(chunk):
    from bayesfl.training import forward_stacked, forward_stacked_concat

    sizes = [7, 1, 12, 4, 3]
    xs, _ = _client_data(sizes)
    models = [_bn_mlp(k) for k in range(len(sizes))]
    with torch.no_grad():
        want = [m.eval()(x) for m, x in zip(models, xs, strict=True)]
    for m in models:
        m.train()
    together = forward_stacked_concat(models, xs, chunk=chunk)
    torch.testing.assert_close(together, torch.cat(want), rtol=1e-6, atol=1e-6)
    for got, expected in zip(forward_stacked(models, xs, chunk=chunk), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert all(m.training for m in models)  # modes are restored


def test_named_tensors_follow_the_module_even_after_reassignment():
    from bayesfl.training import named_tensors

    model = _bn_mlp(0)
    for kind, named in (("parameters", model.named_parameters()),
                        ("buffers", model.named_buffers())):
        cached = named_tensors(model, kind)
        assert [(n, id(t)) for n, t in cached.items()] == [(n, id(t)) for n, t in named]
    model[0].weight = nn.Parameter(torch.zeros(8, 5))  # cached slots still see the new one
    model[1].running_var = torch.full((8,), 2.0)
    assert named_tensors(model)["0.weight"] is model[0].weight
    assert named_tensors(model, "buffers")["1.running_var"] is model[1].running_var
    with torch.no_grad():
        model[3].bias.add_(1.0)  # in-place updates are visible too (same tensor)
    assert torch.equal(named_tensors(model)["3.bias"], model[3].bias)


def _tensors(model: nn.Module) -> tuple[dict, dict]:
    """Copies of a model's parameters and buffers: a client state's network part."""
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.detach().clone() for n, b in model.named_buffers()})


@pytest.mark.parametrize("sizes", [[7, 23, 1, 12], [10, 9, 6]])
def test_stacked_training_of_tensors_equals_the_plain_loop_and_leaves_the_template(sizes):
    xs, ys = _client_data(sizes)
    config = LocalTraining(epochs=3, lr=1e-2, batch_size=5)
    plain = [_mlp(k) for k in range(len(sizes))]
    params, buffers = zip(*[_tensors(m) for m in plain], strict=True)
    template = _mlp(99)
    template_before = copy.deepcopy(template.state_dict())
    for k, model in enumerate(plain):
        train_plain(model, xs[k], ys[k], _ce, config,
                    generator=torch.Generator().manual_seed(100 + k))
    gens = [torch.Generator().manual_seed(100 + k) for k in range(len(sizes))]
    train_stacked(template, list(params), list(buffers), xs, ys, _ce, config, generators=gens)
    for model, p in zip(plain, params, strict=True):  # trained values written into the dicts
        for name, value in model.named_parameters():
            # float32 rounding over 15 Adam steps; parameters are O(1)
            torch.testing.assert_close(p[name], value, atol=1e-5, rtol=1e-5, msg=name)
    for name, value in template.state_dict().items():  # the template's own tensors unused
        assert torch.equal(value, template_before[name]), name


@pytest.mark.parametrize("chunk", [2, 256])
def test_stacked_forward_of_tensors_equals_each_model_on_its_own_inputs(chunk):
    sizes = [7, 1, 12, 4, 3]
    xs, _ = _client_data(sizes)
    models = [_bn_mlp(k) for k in range(len(sizes))]
    with torch.no_grad():
        want = torch.cat([m.eval()(x) for m, x in zip(models, xs, strict=True)])
    params, buffers = zip(*[_tensors(m) for m in models], strict=True)
    template = _bn_mlp(99).train()
    got = forward_stacked_tensors(template, list(params), list(buffers), xs, chunk=chunk)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert template.training  # its mode is restored


def _ridge(precision):
    """Least squares with a stiff diagonal Gaussian around m: (1/n) sum 0.5 (x w - y)^2 +
    0.5 sum_r p_r (w_r - m_r)^2, solved in closed form: (X^T X / n + diag p) w = X^T y / n + p m."""
    g = torch.Generator().manual_seed(0)
    n, d = 40, 6
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = x @ torch.randn(d, generator=g, dtype=torch.float64) + 0.1 * torch.randn(n, generator=g,
                                                                                 dtype=torch.float64)
    m = 0.05 * torch.randn(d, generator=g, dtype=torch.float64)
    p = torch.full((d,), precision, dtype=torch.float64)
    exact = torch.linalg.solve(x.T @ x / n + torch.diag(p), x.T @ y / n + p * m)
    model = torch.nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(m.view(1, d))  # start at the prior mean, as FedSI's local MAP does
    return model, x, y, m, p, exact


def _squared_error(out, y):
    return 0.5 * (out.squeeze(-1) - y).square()


def test_gaussian_prox_converges_to_the_closed_form_map_for_any_stiffness():
    # precision 1e4 per sample is FedSI's prior (variance 1e-4) at n = 1; at Adam's lr 1e-2 the
    # prior std 1e-2 equals the step, where the gradient route oscillates (next test)
    for precision in (1.0, 1e4):
        model, x, y, m, p, exact = _ridge(precision)
        prox = GaussianProx({"weight": m.view(1, -1)}, {"weight": p.view(1, -1)})
        train_plain(model, x, y, _squared_error,
                    LocalTraining(epochs=1000, lr=1e-2, batch_size=40,
                                  reset_optimizer_each_epoch=False),
                    generator=torch.Generator(), prox=prox)
        # float64 full batch: 1000 steps reach 6e-11 (precision 1) and 1e-17 (1e4); 1e-6 is
        # far below the two solutions' distance from m (0.74 and 1.7e-4) and any rounding
        assert torch.allclose(model.weight.view(-1), exact, atol=1e-6, rtol=0)


@pytest.mark.parametrize("steps", [1, 3])
def test_gaussian_prox_step_is_the_closed_form_with_adams_own_step_size(steps):
    # after Adam's t-th step to z, theta = (z + eta p mean) / (1 + eta p) with Adam's step size
    # eta = lr / (sqrt(v / (1 - beta2^t)) + eps), computed here in float64 from Adam's state
    # (float32 parameters: 1e-6 relative). A step size without the bias correction (1000x
    # at t = 1) or the prior's term misplaced moves theta by > 1e-3
    from bayesfl.adam import Adam

    g = torch.Generator().manual_seed(3)
    theta = torch.randn(40, generator=g).requires_grad_()
    mean, precision = torch.randn(40, generator=g), torch.rand(40, generator=g) * 50
    prox = GaussianProx({"w": mean}, {"w": precision})
    config = LocalTraining(lr=1e-2)
    optimizer = Adam([theta], lr=config.lr, betas=config.betas, eps=config.eps)
    for _ in range(steps):
        theta.grad = torch.randn(40, generator=g)
        optimizer.step()
        z = theta.detach().double().clone()
        v = optimizer.state[theta]["exp_avg_sq"].double()
        t = float(optimizer.state[theta]["step"])
        eta = config.lr / ((v / (1 - config.betas[1] ** t)).sqrt() + config.eps)
        shrink = eta * precision.double()
        expected = (z + shrink * mean.double()) / (1 + shrink)
        prox.apply(optimizer, [("w", theta)], config)
        torch.testing.assert_close(theta.detach().double(), expected, rtol=1e-6, atol=1e-7)


def test_a_stiff_gaussian_in_adams_gradient_misses_the_map_that_prox_reaches():
    model, x, y, m, p, exact = _ridge(1e4)
    penalty = lambda params: 0.5 * (p * (params["weight"].view(-1) - m).square()).sum()  # noqa: E731
    train_plain(model, x, y, _squared_error,
                LocalTraining(epochs=25, lr=1e-2, batch_size=40, reset_optimizer_each_epoch=False),
                generator=torch.Generator(), penalty=penalty)
    plain_error = float((model.weight.detach().view(-1) - exact).abs().max())
    model, *_ = _ridge(1e4)
    train_plain(model, x, y, _squared_error,
                LocalTraining(epochs=25, lr=1e-2, batch_size=40, reset_optimizer_each_epoch=False),
                generator=torch.Generator(),
                prox=GaussianProx({"weight": m.view(1, -1)}, {"weight": p.view(1, -1)}))
    prox_error = float((model.weight.detach().view(-1) - exact).abs().max())
    # the exact MAP sits within ~1e-4 of m; 25 Adam steps leave the gradient route ~lr away
    assert prox_error < 1e-5 < 1e-3 < plain_error


def test_after_epoch_sees_each_completed_epoch():
    model, x, y, *_ = _ridge(1.0)
    seen = []
    train_plain(model, x, y, _squared_error, LocalTraining(epochs=3, lr=1e-2, batch_size=7),
                generator=torch.Generator(), after_epoch=seen.append)
    assert seen == [1, 2, 3]


@pytest.mark.parametrize("reset", [True, False])
def test_batched_training_of_one_mini_batch_per_epoch_equals_the_plain_loop(reset):
    # every client has one mini-batch per epoch: with the optimiser reset each epoch every
    # step is a fresh StackedAdam's last (its moments are never kept), without it only the
    # last epoch's is
    sizes = [5, 3, 4, 1]
    xs, ys = _client_data(sizes)
    config = LocalTraining(epochs=3, lr=1e-2, batch_size=5, reset_optimizer_each_epoch=reset)
    plain = [_mlp(k) for k in range(len(sizes))]
    batched = copy.deepcopy(plain)
    for k, model in enumerate(plain):
        train_plain(model, xs[k], ys[k], _ce, config,
                    generator=torch.Generator().manual_seed(100 + k))
    gens = [torch.Generator().manual_seed(100 + k) for k in range(len(sizes))]
    train_batched(batched, xs, ys, _ce, config, generators=gens)
    for a, b in zip(plain, batched, strict=True):
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            # float32 rounding over 3 Adam steps; parameters are O(1)
            torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-5, msg=name)


def _proxes(models, seed=7):
    """A GaussianProx per client over the first layer only (the last is trained without one):
    means 0.3 away from the client's weights and precisions 1-100 per sample, so each step's
    shrink factor ``lr * precision / (sqrt(v_hat) + eps)`` is O(0.1-1), neither negligible nor
    so large that every path lands on the mean whatever it does."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for model in models:
        named = {n: p.detach() for n, p in model.named_parameters() if n.startswith("0.")}
        out.append(GaussianProx(
            {n: p + 0.3 * torch.randn(p.shape, generator=g) for n, p in named.items()},
            {n: 10.0 ** (2 * torch.rand(p.shape, generator=g)) for n, p in named.items()}))
    return out


def _train_both_ways(sizes, config, proxes_of):
    """Client models trained one by one with `train_plain` and together with `train_batched`
    (the same initial weights, generators and prox terms); returns (plain, batched, the
    batched path's generators)."""
    xs, ys = _client_data(sizes)
    plain = [_mlp(k) for k in range(len(sizes))]
    batched = copy.deepcopy(plain)
    proxes = proxes_of(plain)
    for k, model in enumerate(plain):
        train_plain(model, xs[k], ys[k], _ce, config, prox=proxes[k],
                    generator=torch.Generator().manual_seed(100 + k))
    gens = [torch.Generator().manual_seed(100 + k) for k in range(len(sizes))]
    train_batched(batched, xs, ys, _ce, config, generators=gens, prox=proxes)
    return plain, batched, gens


@pytest.mark.parametrize("reset", [True, False])
@pytest.mark.parametrize(
    "sizes",
    [[10, 9, 6],  # two steps each: StackedAdam, one shared step count
     [7, 23, 1, 12]],  # 2, 5, 1, 3 steps: masked Adam, a step count per client, idle clients
)
def test_stacked_training_with_a_prox_equals_the_plain_loop_with_it(reset, sizes):
    config = LocalTraining(epochs=3, lr=1e-2, batch_size=5, reset_optimizer_each_epoch=reset)
    plain, batched, gens = _train_both_ways(sizes, config, _proxes)
    for k, (a, b) in enumerate(zip(plain, batched, strict=True)):
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            # the Adam steps agree to float32 rounding (vmapped gradients, the masked Adam's
            # rearranged formula); the prox's formula is the same elementwise arithmetic and a
            # contraction towards the mean, so it adds no more than rounding: 1e-5 on O(1)
            # weights over at most 15 steps, as the paths without a prox
            torch.testing.assert_close(pa, pb, atol=1e-5, rtol=1e-5, msg=f"{k} {name}")
        # and each generator drew what train_plain's did (one randperm an epoch)
        want = torch.Generator().manual_seed(100 + k)
        for _ in range(config.epochs):
            torch.randperm(sizes[k], generator=want)
        assert torch.equal(gens[k].get_state(), want.get_state())


def test_a_client_without_a_mini_batch_left_is_not_shrunk_by_the_others_steps():
    # client 0 has one row, so one step an epoch, while client 1 takes four: one epoch gives
    # client 0 one Adam step and one prox, and nothing at the three steps it sits out. Its
    # prox is stiff and its mean 1 away, so every extra shrink would pull it well towards the
    # mean (one more shrink moves a weight by up to 0.25, far above the tolerance)
    config = LocalTraining(epochs=1, lr=1e-2, batch_size=5)

    def far_stiff(models):
        return [GaussianProx({n: p.detach() + 1.0 for n, p in m.named_parameters()},
                             {n: torch.full_like(p, 30.0) for n, p in m.named_parameters()})
                for m in models]

    plain, batched, _ = _train_both_ways([1, 20], config, far_stiff)
    for (name, pa), (_, pb) in zip(plain[0].named_parameters(), batched[0].named_parameters(),
                                   strict=True):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_entropy_per_sample_is_torch_cross_entropy_bit_for_bit(dtype):
    # the same log-softmax, then a gather and a negation where nll_loss picks and negates:
    # equal with torch.equal (not just close), the losses and their gradients, for one
    # client and for stacked clients under vmap with train_stacked's masked mean (whose
    # padding rows give zero upstream gradients)
    from torch.func import vmap

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 6, 5, generator=g, dtype=dtype) * 20).requires_grad_()
    labels = torch.randint(0, 5, (4, 6), generator=g)
    mask = (torch.arange(6) < torch.tensor([6, 3, 1, 0])[:, None]).to(dtype)
    losses = (lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
              cross_entropy_per_sample)

    def both(compute):
        a, b = (compute(loss) for loss in losses)
        assert torch.equal(a, b)
        return a, b

    both(lambda loss: loss(logits[0], labels[0]))
    both(lambda loss: torch.autograd.grad(loss(logits[1], labels[1]).mean(), [logits])[0])
    both(lambda loss: vmap(loss)(logits, labels))
    batched = both(lambda loss: vmap(
        lambda out, y, m: (loss(out, y) * m).sum() / m.sum().clamp_min(1.0))(
        logits, labels, mask))
    grads = [torch.autograd.grad(total.sum(), [logits])[0] for total in batched]
    assert torch.equal(*grads)


def test_pad_stack_pads_each_tensor_to_the_longest_with_zeros():
    g = torch.Generator().manual_seed(0)
    for sizes in ([3, 1, 0, 4], [2, 2, 2], [0, 0], [5]):
        tensors = [torch.randn(n, 2, 3, generator=g) for n in sizes]
        got = pad_stack(tensors)
        assert got.shape == (len(sizes), max(sizes), 2, 3)
        for k, t in enumerate(tensors):
            assert torch.equal(got[k, : len(t)], t)
            assert not got[k, len(t):].any()  # the padding is zeros
    labels = pad_stack([torch.tensor([3, 1]), torch.tensor([2])])  # integers keep their dtype
    assert labels.dtype == torch.int64 and labels.tolist() == [[3, 1], [2, 0]]
    mixed = pad_stack([torch.ones(2, dtype=torch.float64), torch.ones(1)])  # the first's dtype
    assert mixed.dtype == torch.float64 and mixed.tolist() == [[1.0, 1.0], [1.0, 0.0]]


@pytest.mark.parametrize("strategy", ["fedlog", "fedavg", "fedproto"])
def test_a_batched_fit_in_a_fresh_process_does_not_import_sympy(strategy):
    # F.cross_entropy under vmap runs torch's nll_loss decomposition, whose shape checks
    # import sympy (0.6 s per process on a quiet machine); FedLog's objective, the FedAvg
    # family's and FedProto's (bayesfl.strategies.networks.cross_entropy_per_sample) are
    # cross_entropy_per_sample, which vmaps without it
    code = textwrap.dedent(f"""
        import sys
        from bayesfl.simulate import simulate
        result = simulate("{strategy}", dataset="digits", clients=6, partition="iid", rounds=2,
                          seed=0, local_epochs=1, batched=True, progress=False)
        assert result.metrics[-1]["round"] == 2
        print(sorted(m for m in ("sympy", "torch._dynamo") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
