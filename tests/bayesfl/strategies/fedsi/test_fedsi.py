"""FedSI and FedSI-Fac (spec fedsi.md): uploads, the server rules, the prior term, upload
screening, and short runs through the simulator and the CLI."""

import copy
import json

import pytest
import torch
from strategy_helpers import fit_all, generators, run_round, wire

from bayesfl.cli import main
from bayesfl.messages import Message
from bayesfl.simulate import simulate
from bayesfl.strategies import MAP_PLUGIN, PREDICTIVE, make_strategy
from bayesfl.strategies.fedsi import fedsi as fedsi_module
from bayesfl.strategies.fedsi.fedsi import aggregate_gaussians, body_vector, prior_penalty
from bayesfl.training import train_batched
from inference.subnet import DiagonalLaplacePosterior, SubnetLaplacePosterior, select_subnet

# digits, 5 clients, small local work: the CI runs of FedSI and FedSI-Fac
DIGITS = dict(dataset="digits", clients=5, partition="shards:2", seed=0, body="mlp",
              feature_dim=16, local_epochs=1, batch_size=64, progress=False)


def test_upload_std_is_zero_exactly_outside_the_subnet_the_client_selected(build):
    strategy, clients, state = build("fedsi", subnet_fraction=0.1)
    state, uploads = run_round(strategy, clients, state, 1)
    S = strategy.subnet_count()
    assert S == 9  # floor(0.1 * 92): mlp:8 body on 6 inputs, feature_dim 4
    prior = 1.0 / strategy.broadcast_tensors(strategy.init(), 1)["variance"].double()
    for client, upload in zip(clients, uploads, strict=True):
        std, subnet = upload.tensors["std"], upload.tensors["subnet"].long()
        assert subnet.numel() == S
        inside = torch.zeros_like(std, dtype=torch.bool)
        inside[subnet] = True
        assert bool((std[~inside] == 0).all()) and bool((std[inside] > 0).all())
        # the declared subnet is what selection picks at the client's MAP (its new state)
        model = strategy.client_model(client.config, client.state)
        model.head.requires_grad_(False)
        assert torch.equal(upload.tensors["mean"], body_vector(model))
        again = select_subnet(model, strategy.curvature_batches(client.data), S, prior)
        assert torch.equal(again, subnet)


def test_fedsi_fac_uploads_a_positive_std_for_every_body_parameter(build):
    strategy, clients, state = build("fedsi-fac")
    _, uploads = run_round(strategy, clients, state, 1)
    for upload in uploads:
        assert "subnet" not in upload.tensors
        std = upload.tensors["std"].double()
        # a diagonal Laplace variance is 1 / (diag GGN + 1/alpha) <= alpha
        limit = strategy.prior_var ** 0.5 * (1 + 1e-6)
        assert bool((std > 0).all()) and bool((std <= limit).all())


# Hand-made uploads: 3 clients, 4 body entries; alpha = 1e-2 (above every uploaded variance,
# so the clamp does not act). Expected values are worked by hand in the comments.
MEANS = torch.tensor([[1.0, 1.0, 1.0, 4.0], [4.0, 2.0, 2.0, 0.0], [2.0, 4.0, 6.0, 2.0]],
                     dtype=torch.float64)
STDS = torch.tensor([[0.05, 0.0, 0.0, 0.0], [0.05, 0.02, 0.0, 0.0], [0.0, 0.04, 0.0, 0.0]],
                    dtype=torch.float64)
ALPHA = 1e-2
THIRDS = torch.full((3,), 1 / 3, dtype=torch.float64)


def test_paper_rule_averages_means_and_stds_with_zeros_and_resets_to_alpha():
    mean, variance = aggregate_gaussians(MEANS, STDS, THIRDS,
                                         torch.full((4,), ALPHA), rule="mean_std", alpha=ALPHA,
                                         floor=1e-12)
    # means: (1+4+2)/3, (1+2+4)/3, (1+2+6)/3, (4+0+2)/3
    assert torch.allclose(mean, torch.tensor([7 / 3, 7 / 3, 3.0, 2.0], dtype=torch.float64))
    # stds averaged with the zeros: (0.05+0.05+0)/3, (0+0.02+0.04)/3; nobody -> alpha
    expected = torch.tensor([(0.1 / 3) ** 2, 0.02**2, ALPHA, ALPHA], dtype=torch.float64)
    assert torch.allclose(variance, expected, rtol=1e-12, atol=0)
    # the order of the uploads does not matter
    perm = torch.tensor([2, 0, 1])
    again = aggregate_gaussians(MEANS[perm], STDS[perm], THIRDS,
                                torch.full((4,), ALPHA), rule="mean_std", alpha=ALPHA,
                                floor=1e-12)
    assert torch.allclose(again[0], mean) and torch.allclose(again[1], variance)


def test_product_rule_weighs_by_precision_and_multiplies_the_stochastic_gaussians():
    mean, variance = aggregate_gaussians(MEANS, STDS, torch.full((3,), 1 / 3),
                                         torch.full((4,), ALPHA), rule="product", alpha=ALPHA,
                                         floor=1e-12)
    # entry 0: precisions 400, 400 and (deterministic: 1/alpha) 100:
    #   mean (400*1 + 400*4 + 100*2) / 900 = 2200/900, variance 1/(400+400)
    # entry 1: precisions 100 (deterministic), 2500, 625:
    #   mean (100*1 + 2500*2 + 625*4) / 3225 = 7600/3225, variance 1/(2500+625)
    # entries 2, 3: nobody stochastic: the plain mean and alpha
    assert torch.allclose(mean, torch.tensor([2200 / 900, 7600 / 3225, 3.0, 2.0],
                                             dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.allclose(variance, torch.tensor([1 / 800, 1 / 3125, ALPHA, ALPHA],
                                                 dtype=torch.float64), rtol=1e-12, atol=0)


def test_variances_are_clamped_to_the_floor_and_alpha():
    stds = torch.tensor([[1e-9, 0.5], [1e-9, 0.5]], dtype=torch.float64)
    _, variance = aggregate_gaussians(torch.zeros(2, 2, dtype=torch.float64), stds,
                                      torch.full((2,), 0.5), torch.full((2,), 1e-4),
                                      rule="mean_var", alpha=1e-4, floor=1e-12)
    assert variance.tolist() == [1e-12, 1e-4]


def _honest_uploads(build, **options):
    strategy, clients, state = build("fedsi", subnet_fraction=0.1, **options)
    plan = strategy.configure(state, 1)
    down = wire(plan.broadcast)
    ups = [wire(strategy.fit(c.config, c.state, c.data, down, g)[1])
           for c, g in zip(clients, generators(clients, 1), strict=True)]
    return strategy, plan, ups


def test_the_server_aggregate_is_the_paper_rule_of_what_it_received(build):
    strategy, plan, ups = _honest_uploads(build)
    new = strategy.aggregate(plan.state, ups, 1, torch.Generator())
    means = torch.stack([u.tensors["mean"].double() for u in ups])
    stds = torch.stack([u.tensors["std"].double() for u in ups])
    expected = stds.mean(0).square()
    alpha = strategy.prior_var
    expected = torch.where(expected > 0, expected, torch.full_like(expected, alpha))
    assert torch.allclose(new["mean"].double(), means.mean(0).float().double())
    assert torch.allclose(new["variance"], expected.clamp(1e-12, alpha), rtol=1e-12, atol=0)


def _forged(upload, **tensors):
    return Message(upload.header, {**upload.tensors, **tensors})


def test_poisoned_uploads_are_rejected_with_their_reason(build):
    strategy, plan, ups = _honest_uploads(build)
    assert strategy.validate_uploads(plan, ups, [0, 1, 2]) == [None, None, None]
    honest = ups[0]
    std, subnet = honest.tensors["std"].clone(), honest.tensors["subnet"]
    outside = next(i for i in range(std.numel()) if i not in set(subnet.tolist()))
    leak = std.clone()
    leak[outside] = 1e-3
    inflated = std.clone()
    inflated[subnet[0]] = 1.0  # prior std is 1e-2
    negative = std.clone()
    negative[subnet[0]] = -std[subnet[0]]
    zero_inside = std.clone()
    zero_inside[subnet[0]] = 0.0
    cases = {
        "outside the declared subnet": _forged(honest, std=leak),
        "above the broadcast prior std": _forged(honest, std=inflated),
        "negative standard deviations": _forged(honest, std=negative),
        "inside the declared subnet": _forged(honest, std=zero_inside),
        "not sorted and unique": _forged(honest, subnet=subnet.flip(0)),
        "expected (9)": _forged(honest, subnet=subnet[:-1]),
        "num_samples must be >= 1": _forged(honest, num_samples=torch.tensor([0])),
    }
    for reason, forged in cases.items():
        verdict = strategy.validate_uploads(plan, [forged, ups[1], ups[2]], [0, 1, 2])
        assert verdict[0] is not None and reason in verdict[0], (reason, verdict[0])
        assert verdict[1:] == [None, None]


def test_the_prior_term_uses_the_broadcast_variances(build):
    strategy, clients, state = build("fedsi")
    g = torch.Generator().manual_seed(5)
    R = state["mean"].numel()
    state["variance"] = torch.exp(torch.empty(R, dtype=torch.float64).uniform_(-9, -2,
                                                                            generator=g))
    down = wire(strategy.configure(state, 1).broadcast)
    mean, variance = strategy.received(clients[0].config, down)
    assert torch.equal(variance, state["variance"].float())  # what crossed the wire
    model = strategy.model_at(clients[0].config, clients[0].state, mean)
    with torch.no_grad():  # move the body away from the prior mean
        for p in model.body.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    data, n = clients[0].data, clients[0].data.num_train
    objective = strategy.map_objective(model, mean, variance, n)
    x, y = data.train_x[:5], data.train_y[:5]
    with_prior = torch.autograd.grad(objective(model(x), y).mean(),
                                     list(model.body.parameters()))
    plain = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y),
                                list(model.body.parameters()))
    prior_grad = torch.cat([(a - b).reshape(-1) for a, b in zip(with_prior, plain, strict=True)])
    theta = body_vector(model)
    by_hand = (theta - mean) / variance / n
    assert float(by_hand.abs().max()) > 1.0  # the body really is away from the prior mean
    # float32 gradients of terms up to ~1e4: relative 1e-4 covers the rounding
    assert torch.allclose(prior_grad, by_hand, rtol=1e-4, atol=1e-6)
    assert float(prior_penalty(theta, mean, variance)) == pytest.approx(
        0.5 * float(((theta - mean).double() ** 2 / variance.double()).sum()), rel=1e-5)


def test_the_broadcast_variances_change_the_local_map_only_through_the_prior(build):
    strategy, clients, state = build("fedsi")
    off = make_strategy("fedsi", strategy.context, prior_in_map=False)
    g = torch.Generator().manual_seed(2)
    R = state["mean"].numel()
    other = {**state, "variance": torch.empty(R, dtype=torch.float64).uniform_(1e-4, 1e-2,
                                                                               generator=g)}
    c = clients[0]

    def local_mean(strat, server_state):
        down = wire(strat.configure(server_state, 1).broadcast)
        new_state, up = strat.fit(c.config, c.state, c.data, down,
                                  torch.Generator().manual_seed(0))
        # the head never changes during training (phi^0 stays)
        assert torch.equal(new_state["model.head.weight"], c.state["model.head.weight"])
        return up.tensors["mean"]

    assert not torch.equal(local_mean(strategy, state), local_mean(strategy, other))
    assert torch.equal(local_mean(off, state), local_mean(off, other))


@pytest.mark.parametrize("name, kind", [("fedsi", SubnetLaplacePosterior),
                                        ("fedsi-fac", DiagonalLaplacePosterior)])
@pytest.mark.trained
def test_three_rounds_on_digits(name, kind):
    result = simulate(name, rounds=3, **DIGITS)
    s = result.summary
    assert [m["round"] for m in result.metrics] == [1, 2, 3]
    assert all(m["accepted"] == 5 and not m["rejections"] for m in result.metrics)
    # learning, on any CPU: over seeds 0-4 both methods ended at 0.67-0.89 (sd 0.08); chance is
    # 0.1, so 0.3 is far outside what rounding (which moves a run as a seed does) can reach
    assert s["personalized"] and 0.3 < s["accuracy"] <= 1.0
    assert MAP_PLUGIN in s and s["nll"] > 0
    post = result.posterior(1)
    assert isinstance(post, kind)
    R = 64 * 16 + 16
    assert post.sample(3).shape == (3, R)
    client = result.clients[1]
    x = client.data.test_x
    probs = result.predict_proba(1, x)
    assert torch.allclose(probs, post.predict_proba(x).double(), atol=1e-6)
    both = result.strategy.predict(client.config, result.client_state(1),
                                   result.evaluation_broadcast, x)
    assert torch.allclose(both[MAP_PLUGIN], post.predict_proba(x, "map").double(), atol=1e-6)
    assert torch.allclose(both[PREDICTIVE].sum(1), torch.ones(x.shape[0], dtype=torch.float64))
    if name == "fedsi":
        assert post.n_subnet == int(0.05 * R)
        assert 0 < result.metrics[-1]["fedsi_stochastic_fraction"] < 1


def test_unknown_options_are_refused():
    from strategy_helpers import context

    from bayesfl.errors import ConfigError

    for bad in ({"aggregation": "median"}, {"posterior": "full"}, {"subnet_fraction": 0.0},
                {"prior_var": 1e-4, "variance_floor": 1e-3}, {"head_init": "random"}):
        with pytest.raises(ConfigError):
            make_strategy("fedsi", context(), **bad)


def test_per_client_heads_differ_and_shared_heads_agree(build):
    _, clients, _ = build("fedsi", head_init="per_client")
    heads = [c.state["model.head.weight"] for c in clients]
    assert not torch.equal(heads[0], heads[1])
    _, clients, _ = build("fedsi")
    assert torch.equal(clients[0].state["model.head.weight"], clients[1].state["model.head.weight"])


def test_cli_runs_fedsi_with_novel_clients(tmp_path):
    out = tmp_path / "run"
    code = main(["run", "--strategy", "fedsi", "--dataset", "digits", "--clients", "5",
                 "--rounds", "2", "--body", "mlp", "--feature-dim", "16", "--local-epochs", "1",
                 "--batch-size", "64", "--novel-fraction", "0.2", "--no-progress",
                 "--option", "finetune_epochs=2", "--out", str(out)])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "fedsi" and len(summary["per_client"]) == 4
    assert len(summary["novel"]["clients"]) == 1 and "ece" in summary["novel"]
    assert (out / "metrics.jsonl").exists() and (out / "manifest.json").exists()



# ---- personalisation's selection, and every documented option ---------------------------------
def spread_variances(state, seed=5):
    """``state`` with distinct broadcast variances in [0.5, 1] (no ties to rank; large enough
    that the clients' curvature reorders them)."""
    R = state["mean"].numel()
    g = torch.Generator().manual_seed(seed)
    return {**state, "variance": torch.empty(R, dtype=torch.float64).uniform_(0.5, 1.0,
                                                                             generator=g)}


def personalized(strategy, client, state):
    down = wire(strategy.configure_evaluation(state, 1))
    return strategy.personalize(client.config, client.state, client.data, down,
                                torch.Generator().manual_seed(0)), down


def test_global_var_selection_at_personalisation_takes_the_largest_broadcast_variances(build):
    # eval_selection="global_var" ranks by g alone: the subnet is the |S| entries of largest
    # broadcast variance, whatever the client's curvature; the default ranks by the
    # diagonal-Laplace variance 1 / (diag GGN + 1/g) at (mu, phi_fin)
    strategy, clients, state = build("fedsi", prior_var=1.0, subnet_size=6,
                                     eval_selection="global_var")
    state = spread_variances(state)
    new, _ = personalized(strategy, clients[1], state)
    largest = torch.topk(state["variance"].float(), 6).indices.sort().values
    assert torch.equal(new["posterior.subnet_indices"], largest)
    default = make_strategy("fedsi", strategy.context, prior_var=1.0, subnet_size=6)
    other, _ = personalized(default, clients[1], state)
    model = default.client_model(clients[1].config, other)
    model.head.requires_grad_(False)
    expected = select_subnet(model, default.curvature_batches(clients[1].data), 6,
                             1.0 / state["variance"].float().double())
    assert torch.equal(other["posterior.subnet_indices"], expected)
    assert not torch.equal(expected, largest)


def full_batch_context(lr=1e-2):
    from strategy_helpers import context

    from bayesfl.training import LocalTraining

    return context(training=LocalTraining(epochs=1, lr=lr, batch_size=64))


@pytest.mark.parametrize("local_lr, step", [(3e-3, 3e-3), (None, 2e-2)])
def test_local_lr_is_the_adam_step_of_the_local_map(local_lr, step):
    # one full batch, one Adam step from theta = mu (where the prior term's gradient is 0):
    # every body entry moves by lr * g / (|g| + 1e-8), the largest by lr itself; None takes
    # the run's lr (here 2e-2). The paper's solver: the prior inside Adam's gradient.
    from strategy_helpers import make_clients

    strategy = make_strategy("fedsi", full_batch_context(lr=2e-2), local_lr=local_lr,
                             map_solver="adam")
    c = make_clients(strategy)[1]
    state = strategy.init()
    _, up = strategy.fit(c.config, c.state, c.data, wire(strategy.configure(state, 1).broadcast),
                         torch.Generator())
    moved = float((up.tensors["mean"].double() - state["mean"].double()).abs().max())
    assert moved == pytest.approx(step, rel=1e-4)  # float32 parameters of O(1)


@pytest.mark.parametrize("prior_var", [1e-4, 1e-2])
def test_the_proximal_map_solver_applies_the_prior_exactly_after_each_adam_step(prior_var):
    # One full batch, one step from theta = mu. Adam's step is s = lr g / (|g| + eps) (g the
    # CE gradient at mu: m_hat = g, sqrt(v_hat) = |g|); its step size eta = lr / (|g| + eps);
    # the prior N(mu, prior_var) per sample has precision b = 1 / (n prior_var). The exact
    # proximal step puts theta - mu = -s / (1 + eta b).
    from strategy_helpers import make_clients

    lr = 1e-2
    strategy = make_strategy("fedsi", full_batch_context(lr=lr), prior_var=prior_var)
    c = make_clients(strategy)[1]
    state = strategy.init()
    mean = state["mean"].float()
    model = strategy.model_at(c.config, c.state, mean)
    loss = torch.nn.functional.cross_entropy(model(c.data.train_x), c.data.train_y)
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(
        loss, list(model.body.parameters()))]).double()
    eta = lr / (g.abs() + 1e-8)
    b = 1.0 / (c.data.num_train * prior_var)
    expected = -(lr * g / (g.abs() + 1e-8)) / (1 + eta * b)
    _, up = strategy.fit(c.config, c.state, c.data, wire(strategy.configure(state, 1).broadcast),
                         torch.Generator())
    moved = up.tensors["mean"].double() - state["mean"].double()
    # float32 parameters of O(0.1-1): their spacing, ~1e-8, bounds the error of a move
    assert torch.allclose(moved, expected, rtol=0, atol=5e-7)
    # the stiff prior (1e-4: b = 1e4 / n) holds the move far below Adam's lr; the weak one not
    assert (float(moved.abs().max()) < lr / 2) == (prior_var == 1e-4)


@pytest.mark.parametrize("sizes", [
    (12, 20, 7),  # 3, 4 and 2 mini-batches an epoch: the masked Adam, idle clients
    (10, 9, 6),  # 2 each: one Adam over the stack
])
def test_a_group_fit_trains_the_local_maps_together_and_uploads_what_each_fit_does(
        build, monkeypatch, sizes):
    strategy, clients, state = build("fedsi", sizes=sizes, subnet_fraction=0.1)
    down = wire(strategy.configure(state, 1).broadcast)
    twins = copy.deepcopy(clients)
    alone, together = generators(clients, 1), generators(twins, 1)
    one = fit_all(strategy, clients, down, alone)
    calls = []
    monkeypatch.setattr(fedsi_module, "train_batched",
                        lambda *a, **k: calls.append(1) or train_batched(*a, **k))
    monkeypatch.setattr(fedsi_module, "train_plain", None)  # the group never trains alone
    group = fit_all(strategy, twins, down, together, batched=True)
    assert calls == [1]  # every client's local MAP in one stacked training
    for (state1, up1), (state2, up2), g1, g2 in zip(one, group, alone, together, strict=True):
        # the MAPs agree to float32 rounding (vmapped gradients; masked Adam), and so the
        # curvature and the subnet chosen from it
        assert torch.equal(up1.tensors["subnet"], up2.tensors["subnet"])
        for key in up1.tensors:
            torch.testing.assert_close(up1.tensors[key], up2.tensors[key], rtol=1e-4, atol=1e-5,
                                       msg=key)
        assert state1.keys() == state2.keys()
        for key in state1:
            torch.testing.assert_close(state1[key], state2[key], rtol=1e-5, atol=1e-5, msg=key)
        # the same shuffles drawn: each generator ends where the client's own fit left it
        assert torch.equal(g1.get_state(), g2.get_state())



def test_finetune_epochs_and_lr_are_the_heads_adam_steps_at_personalisation():
    # a full batch: finetune_epochs 1 is one Adam step of the head (largest move finetune_lr),
    # 0 leaves the head at phi^0
    from strategy_helpers import make_clients

    for epochs, step in ((1, 4e-3), (0, 0.0)):
        strategy = make_strategy("fedsi", full_batch_context(), finetune_epochs=epochs,
                                 finetune_lr=4e-3, finetune_stop="fixed")
        c = make_clients(strategy)[1]
        new, _ = personalized(strategy, c, strategy.init())
        moved = float((new["model.head.weight"] - c.state["model.head.weight"]).abs().max())
        assert moved == pytest.approx(step, rel=1e-4, abs=0)


def test_prior_var_is_the_initial_variance_the_reset_value_and_the_upper_clamp(build):
    strategy, clients, state = build("fedsi", prior_var=1e-3, subnet_size=3)
    assert bool((state["variance"] == 1e-3).all())
    _, uploads = run_round(strategy, clients, dict(state), 1)
    new = strategy.aggregate(state, uploads, 1, torch.Generator())
    chosen = torch.zeros_like(new["variance"], dtype=torch.bool)
    for u in uploads:
        chosen[u.tensors["subnet"].long()] = True
    assert bool((new["variance"][~chosen] == 1e-3).all())  # nobody made them stochastic
    assert bool((new["variance"][chosen] < 1e-3).all())


def test_subnet_size_overrides_the_fraction(build):
    strategy, clients, state = build("fedsi", subnet_size=5, subnet_fraction=0.5)
    assert strategy.subnet_count() == 5
    _, uploads = run_round(strategy, clients, state, 1)
    assert all(u.tensors["subnet"].numel() == 5 for u in uploads)
    assert all(int((u.tensors["std"] > 0).sum()) == 5 for u in uploads)


def test_subnet_diag_is_the_diagonal_laplace_on_the_subnet(build):
    # the same client, MAP and subnet under three posteriors: subnet_diag's stds are the
    # diagonal Laplace's (FedSI-Fac's) on the subnet; the full subnet covariance's marginals
    # are at least as large ([A^-1]_rr >= 1 / A_rr for positive definite A), larger somewhere.
    # prior variance 1e3: the GGN, not the prior, shapes the posterior (stds 10-30 against
    # the prior's 32)
    options = dict(prior_var=1e3)
    strategy, clients, state = build("fedsi", subnet_size=8, posterior="subnet_diag", **options)
    context = strategy.context
    c = clients[1]
    down = wire(strategy.configure(state, 1).broadcast)

    def upload(s):
        return s.fit(c.config, c.state, c.data, down, torch.Generator().manual_seed(4))[1]

    diag = upload(strategy)
    full = upload(make_strategy("fedsi", context, subnet_size=8, **options))
    every = upload(make_strategy("fedsi-fac", context, **options))
    subnet = diag.tensors["subnet"].long()
    assert torch.equal(full.tensors["subnet"].long(), subnet)
    assert torch.equal(diag.tensors["mean"], every.tensors["mean"])
    # float32 stds from float64 curvature: rounding only
    torch.testing.assert_close(diag.tensors["std"][subnet], every.tensors["std"][subnet],
                               rtol=1e-5, atol=0)
    assert bool((full.tensors["std"][subnet] >= diag.tensors["std"][subnet] * (1 - 1e-5)).all())
    assert bool((full.tensors["std"][subnet] > diag.tensors["std"][subnet] * 1.1).any())


@pytest.mark.parametrize("options, mean0, variance", [
    # the hand-made uploads above (alpha 1e-2); counts 1, 1, 2
    ({"aggregation": "mean_std"}, 7 / 3, [(0.1 / 3) ** 2, 0.02**2, ALPHA, ALPHA]),
    ({"aggregation": "mean_var"}, 7 / 3, [0.005 / 3, 0.002 / 3, ALPHA, ALPHA]),
    # over the clients that chose the entry: (0.05^2 + 0.05^2) / 2, (0.02^2 + 0.04^2) / 2
    ({"aggregation": "mean_nonzero"}, 7 / 3, [0.0025, 0.001, ALPHA, ALPHA]),
    ({"aggregation": "product"}, 2200 / 900, [1 / 800, 1 / 3125, ALPHA, ALPHA]),
    # n_i weights 1/4, 1/4, 1/2: mean (1 + 4 + 2 * 2) / 4, stds (0.05 + 0.05) / 4 and
    # (0.02 + 2 * 0.04) / 4
    ({"weights": "n_i"}, 9 / 4, [0.025**2, 0.025**2, ALPHA, ALPHA]),
    # the floor 1e-3 lifts entry 1's 0.02^2 = 4e-4 (and entry 0's 1.1e-3 stays)
    ({"variance_floor": 1e-3}, 7 / 3, [(0.1 / 3) ** 2, 1e-3, ALPHA, ALPHA]),
])
def test_the_server_applies_its_aggregation_weights_and_floor_options(options, mean0, variance):
    from strategy_helpers import context

    strategy = make_strategy("fedsi", context(), prior_var=ALPHA, **options)
    state = {"mean": torch.zeros(4), "variance": torch.full((4,), ALPHA, dtype=torch.float64)}
    ups = [strategy.up_message(1, k, {"mean": MEANS[k].float(), "std": STDS[k].float(),
                                      "num_samples": torch.tensor([n])})
           for k, n in enumerate((1, 1, 2))]
    new = strategy.aggregate(state, ups, 1, torch.Generator())
    assert float(new["mean"][0]) == pytest.approx(mean0, rel=1e-6)  # float32 means
    # float32 stds (relative rounding 6e-8), squared and combined in float64
    torch.testing.assert_close(new["variance"], torch.tensor(variance, dtype=torch.float64),
                               rtol=1e-6, atol=0)


def test_moment_matching_gives_the_mixtures_variance():
    # mixture of N(m_k, s_k^2) with weights 1/3: mean(s^2 + m^2) - mean(m)^2;
    # entry 0: (0.0025 + 1 + 0.0025 + 16 + 4) / 3 - 49/9; entry 1: (1 + 4.0004 + 16.0016) / 3
    # - 49/9; entries 2 and 3 nobody chose: alpha (10, above the mixture variances)
    _, variance = aggregate_gaussians(MEANS, STDS, THIRDS, torch.full((4,), 10.0),
                                      rule="moment_match", alpha=10.0, floor=1e-12)
    expected = [21.005 / 3 - 49 / 9, 21.002 / 3 - 49 / 9, 10.0, 10.0]
    torch.testing.assert_close(variance, torch.tensor(expected, dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)


def test_filter_zero_curvature_ranks_entries_without_curvature_last_or_first(build):
    # a dead hidden unit (zero weights in, bias -10: its ReLU never fires) has zero GGN on its
    # 7 incoming and 4 outgoing weights; at equal prior variance their diagonal-Laplace
    # variance is the largest, 1 / (0 + 1/g), so the paper's literal rule (False) picks them
    # first and the default ranks them last
    from inference.subnet.diagonal_posterior import fit_diagonal_laplace

    for keep in (True, False):
        strategy, clients, state = build("fedsi", subnet_size=6, filter_zero_curvature=keep)
        c = clients[1]
        model = strategy.model_at(c.config, c.state, state["mean"])
        first = next(m for m in model.body.modules() if isinstance(m, torch.nn.Linear))
        with torch.no_grad():
            first.weight[0].zero_()
            first.bias[0] = -10.0
        model.head.requires_grad_(False)
        batches = strategy.curvature_batches(c.data)
        variance = state["variance"].float()
        ggn = fit_diagonal_laplace(model, batches, 1.0 / variance.double()).state_dict()
        flat = ggn["ggn_diagonal"]
        dead = set(torch.nonzero(flat <= 1e-12 * flat.max()).flatten().tolist())
        assert len(dead) >= 11
        subnet = set(strategy.choose_subnet(model, batches, variance).tolist())
        assert subnet <= dead if not keep else not subnet & dead


def test_glm_mc_predictive_draws_mc_samples_weights():
    from strategy_helpers import make_clients

    from bayesfl.strategies.base import derived_seed

    strategy = make_strategy("fedsi", full_batch_context(), predictive="glm_mc", mc_samples=5,
                             finetune_epochs=1)
    c = make_clients(strategy)[1]
    new, down = personalized(strategy, c, strategy.init())
    x = c.data.test_x
    got = strategy.predict(c.config, new, down, x)
    post = strategy.personal_posterior(c.config, new)

    def mc(n):
        g = torch.Generator().manual_seed(derived_seed(strategy.context.seed, 29, 1))
        return post.predict_proba(x, "glm_mc", n_samples=n, generator=g).double()

    assert torch.equal(got[PREDICTIVE], mc(5))
    assert not torch.equal(mc(5), mc(100))
    probit = make_strategy("fedsi", strategy.context, finetune_epochs=1)
    plain = probit.predict(c.config, new, down, x)[PREDICTIVE]
    assert torch.equal(plain, post.predict_proba(x, "glm_probit").double())


@pytest.mark.parametrize("ratio, rejected", [(None, []), (2.0, [2]), (10.0, [])])
def test_screening_ratio_bounds_the_means_distance_to_the_broadcast_mean(build, ratio,
                                                                        rejected):
    # every mean entry moved by 1, 1 and 3: distances in proportion 1 : 1 : 3
    strategy, _, state = build("fedsi", subnet_size=2, screening_ratio=ratio)
    plan = strategy.configure(state, 1)
    std = torch.zeros_like(state["mean"])
    std[:2] = 1e-3  # inside the declared subnet, below the prior std 1e-2
    ups = [wire(strategy.up_message(1, k, {
        "mean": state["mean"] + shift, "std": std, "subnet": torch.tensor([0, 1],
                                                                         dtype=torch.int32),
        "num_samples": torch.tensor([5])})) for k, shift in enumerate((1.0, 1.0, 3.0))]
    verdicts = strategy.validate_uploads(plan, ups, [0, 1, 2])
    assert [k for k, v in enumerate(verdicts) if v is not None] == rejected
    if rejected:
        assert "distance of the mean" in verdicts[2]


def test_curvature_batch_chunks_the_training_set_without_changing_the_upload(build):
    strategy, clients, state = build("fedsi", curvature_batch=3)
    c = clients[1]  # 20 samples
    batches = strategy.curvature_batches(c.data)
    assert [len(y) for _, y in batches] == [3] * 6 + [2]
    assert torch.equal(torch.cat([x for x, _ in batches]), c.data.train_x)
    down = wire(strategy.configure(state, 1).broadcast)
    ups = [s.fit(c.config, c.state, c.data, down, torch.Generator().manual_seed(1))[1]
           for s in (strategy, make_strategy("fedsi", strategy.context))]
    assert torch.equal(ups[0].tensors["subnet"], ups[1].tensors["subnet"])
    # GGN sums over 7 chunks or 1: float64 summation order only
    torch.testing.assert_close(ups[0].tensors["std"], ups[1].tensors["std"], rtol=1e-6, atol=0)


# ---- defaults, refusals and checks the mutation sample found untested (issue 27) -------------
def test_built_directly_every_option_has_its_documented_default():
    # make_strategy passes every option, so only a direct construction sees the signature's
    # defaults: the values of the module docstring's table
    from strategy_helpers import context

    from bayesfl.strategies.fedsi.fedsi import FedSI, FedSIFac

    s = FedSI(context())
    assert (s.prior_var, s.subnet_fraction, s.subnet_size, s.posterior_kind) == (
        1e-2, 0.05, None, "subnet_full")
    assert (s.map_solver, s.finetune_epochs, s.head_tuning.stop) == ("proximal", 100,
                                                                     "heldout_nll")
    assert (s.aggregation, s.weights, s.variance_floor, s.prior_in_map, s.local_lr) == (
        "mean_std", "uniform", 1e-12, True, 1e-2)
    assert (s.head_init, s.filter_zero_curvature, s.eval_selection) == (
        "shared", True, "diag_laplace")
    assert (s.finetune_lr, s.predictive, s.mc_samples) == (1e-2, "glm_probit", 100)
    assert (s.screening_ratio, s.curvature_batch) == (10.0, 256)
    assert FedSIFac(context()).posterior_kind == "diag_all"


@pytest.mark.parametrize("option, value, message", [
    ("prior_var", -1.0, "fedsi prior_var must be a finite number >= 0, got -1.0"),
    ("subnet_size", 0, "fedsi subnet_size must be an integer >= 1, got 0"),
    ("weights", "sqrt", "fedsi weights must be one of uniform, n_i; got 'sqrt'"),
    ("eval_selection", "random",
     "fedsi eval_selection must be one of diag_laplace, global_var; got 'random'"),
    ("screening_ratio", 0.5, "fedsi screening_ratio must be a finite number >= 1, got 0.5"),
    ("curvature_batch", 0, "fedsi curvature_batch must be an integer >= 1, got 0"),
])
def test_a_refused_option_is_named_with_what_it_must_be(option, value, message):
    import re

    from strategy_helpers import context

    from bayesfl.errors import ConfigError

    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        make_strategy("fedsi", context(), **{option: value})


def test_body_size_counts_the_parameters_of_the_body_spec_asked_for(build):
    strategy, _, _ = build("fedsi")  # bodies on 6 inputs to feature_dim 4
    assert strategy.body_size() == 6 * 8 + 8 + 8 * 4 + 4  # the run's mlp:8
    assert strategy.body_size("mlp:16") == 6 * 16 + 16 + 16 * 4 + 4


def test_a_broadcast_variance_of_zero_is_refused(build):
    from bayesfl.errors import MessageRejected

    strategy, clients, state = build("fedsi")
    variance = state["variance"].clone()
    variance[3] = 0.0
    down = wire(strategy.configure({**state, "variance": variance}, 1).broadcast)
    with pytest.raises(MessageRejected, match="variances finite and > 0"):
        strategy.received(clients[0].config, down)


def test_the_posterior_before_personalisation_is_refused_saying_when_it_is_fitted(build):
    from bayesfl.errors import ConfigError

    strategy, clients, state = build("fedsi")
    down = wire(strategy.configure_evaluation(state, 1))
    with pytest.raises(ConfigError, match=r"^client 0 has not personalized: fedsi fits a "
                       r"client's posterior in personalize\(\) after training$"):
        strategy.posterior(clients[0].config, clients[0].state, down)


def test_a_client_may_not_declare_more_samples_than_in_its_first_accepted_upload(build):
    strategy, plan, ups = _honest_uploads(build)  # clients of 12, 20 and 7 samples
    state = strategy.aggregate(plan.state, ups, 1, torch.Generator())
    # the round-1 variances kept, so that the round-1 stds stay below the prior std
    state["variance"] = plan.state["variance"]
    again = [wire(strategy.up_message(2, k, {**u.tensors, "num_samples": torch.tensor([n])}))
             for k, (u, n) in enumerate(zip(ups, (12, 21, 6), strict=True))]
    verdicts = strategy.validate_uploads(strategy.configure(state, 2), again, [0, 1, 2])
    assert verdicts == [None, "num_samples 21 exceeds the 20 this client declared in its first "
                        "accepted upload", None]


@pytest.mark.parametrize(("stop", "sizes"), [("fixed", None), ("heldout_nll", (16, 16, 16))])
def test_rounds_are_evaluated_with_a_head_fine_tuned_on_the_global_body(build, stop, sizes):
    # phi^0 is frozen until personalisation: the round's figures come from the head each
    # client would fine-tune now on the global mean (plug-in under both keys), not phi^0.
    # Clients of one size have their heads tuned together (tune_heads): each the head
    # fine_tuned gives it alone, with its own generator
    from strategy_helpers import evaluation_broadcast

    from bayesfl.strategies.base import derived_seed

    strategy, clients, state = build("fedsi", **({} if sizes is None else {"sizes": sizes}),
                                     subnet_size=3, finetune_epochs=5, finetune_stop=stop)
    state, _ = run_round(strategy, clients, state, 1)
    broadcast = evaluation_broadcast(strategy, state, 1)
    mean = broadcast.tensors["mean"].float()
    evaluations = strategy.evaluate_group([c.config for c in clients],
                                          [c.state for c in clients],
                                          [c.data for c in clients], broadcast, keep_probs=True)
    for c, e in zip(clients, evaluations, strict=True):
        g = torch.Generator().manual_seed(derived_seed(strategy.context.seed, 31,
                                                       c.config.client_id, 1))
        model = strategy.fine_tuned(c.config, c.state, c.data, mean, g)
        expected = torch.softmax(model(c.data.test_x).double(), dim=-1)
        torch.testing.assert_close(e.probs[PREDICTIVE], expected)
        torch.testing.assert_close(e.probs[MAP_PLUGIN], expected)
        frozen = strategy.predict(c.config, c.state, broadcast, c.data.test_x)[PREDICTIVE]
        assert not torch.allclose(e.probs[PREDICTIVE], frozen)
    assert "fine-tuned" in strategy.round_view
