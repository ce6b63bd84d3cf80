"""The parameter-averaging family's shape (issue 42): `ParameterAveraging` does plain parameter
averaging and holds FedPart's partial rounds (`PartialTraining`), the local training's FLOPs
(`LocalFlops`) and the probabilistic head (`HeadPosterior`) as objects; each object is checked
here directly, on a small case, against what the strategy answers and sends."""

import ast
import inspect

import pytest
import torch
from strategy_helpers import NUM_CLASSES, evaluation_broadcast, run_round

from bayesfl.errors import ConfigError
from bayesfl.flops import step_flops
from bayesfl.strategies import MAP_PLUGIN, PREDICTIVE
from bayesfl.strategies.averaging import parameter_averaging
from bayesfl.strategies.averaging.fedpart_schedule import (
    FULL,
    SYNCED,
    LocalFlops,
    PartialTraining,
)
from bayesfl.strategies.averaging.parameter_averaging import PERSONALIZED
from bayesfl.strategies.probabilistic_head import HeadPosterior, head_features, head_from_options

SCHEDULE = {"kind": "fedpart", "warmup_rounds": 1, "rounds_per_group": 1,
            "full_rounds_per_cycle": 0}
"""Round 1 FULL, then one round per layer group: rounds 2 and 3 train groups 0 and 1."""


def test_parameter_averaging_names_no_schedule_or_head_posterior_internals():
    tree = ast.parse(inspect.getsource(parameter_averaging))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names}
    attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    internals = {"FULL", "SYNCED", "SCHEDULE_OPTIONS", "schedule_from_option", "describe_groups",
                 "step_flops", "head_features", "head_posterior", "with_head_posterior",
                 "fallback_reason", "client_posterior", "MAP_PLUGIN"}
    assert not internals & (names | imported)
    assert not {"downlink", "_groups", "_flops", "_round_phases", "_step_flops",
                "_fit_broadcast", "head_posterior"} & attributes


def test_partial_training_answers_what_the_strategy_sends_each_round(build):
    strategy, clients, state = build("fedavg", schedule=SCHEDULE)
    body = clients[0].config.body
    partial = PartialTraining(strategy.name, SCHEDULE, strategy.context,
                              shared=strategy.shared_names,
                              statistics=strategy.shared_statistics,
                              template=strategy.template, phases=strategy.phases)
    groups = partial.groups(body)
    assert len(groups) >= 2 and [g.names for g in groups] == [g.names for g in
                                                               strategy.groups(body)]
    everything = frozenset(state)  # the initial server state: every shared value
    assert [partial.group_at(r) for r in (1, 2, 3)] == [FULL, 0, 1]
    assert partial.round_names(body, 1) == everything
    assert partial.round_names(body, 2) == frozenset(groups[0].names)
    assert partial.broadcast_names(body, 2) == everything  # after a FULL round
    assert partial.broadcast_names(body, 3) == frozenset(groups[0].names + groups[1].names)
    names = frozenset(n for n, _ in strategy.template(body).named_parameters())
    for r, g in ((2, 0), (3, 1)):
        trainable = [frozenset(filter(t, names)) for t, _ in partial.phases(body, r)]
        assert trainable == [frozenset(groups[g].parameters)]
    # a downlink="changed" client must have synced the round before
    with pytest.raises(ConfigError, match="downlink='full'"):
        partial.fit_names(0, {SYNCED: torch.tensor([1])}, body, 3)
    assert partial.fit_names(0, {SYNCED: torch.tensor([2])}, body, 3) == \
        partial.broadcast_names(body, 3)
    flops = LocalFlops(strategy.template, strategy.context)
    epochs = strategy.context.training.epochs
    for r in (1, 2, 3):  # the strategy's messages and FLOPs are the objects' answers
        plan = strategy.configure(state, r)
        assert set(plan.broadcast.tensors) == partial.broadcast_names(body, r)
        state, ups = run_round(strategy, clients, state, r)
        assert all(set(u.tensors) == partial.round_names(body, r) | {"num_samples"}
                   for u in ups)
        assert all(int(c.state[SYNCED].item()) == r for c in clients)
        active = names if r == 1 else frozenset(groups[partial.group_at(r)].parameters)
        per_sample = step_flops(strategy.template(body), strategy.context.input_shape,
                                active.__contains__).total
        n = [int(u.tensors["num_samples"].item()) for u in ups]
        assert [flops.local(body, partial.phases(body, r), k) for k in n] == \
            [k * epochs * per_sample for k in n]
        assert strategy.compute_metrics(plan, ups) == {"flops_local":
                                                       float(sum(n) * epochs * per_sample)}
    assert strategy.describe() == partial.describe()


def test_head_posterior_fits_and_predicts_what_the_strategy_reports(build):
    strategy, clients, state = build("fedper", head="conjugate", local_layers=1)
    state, _ = run_round(strategy, clients, state, 1)
    broadcast = evaluation_broadcast(strategy, state, 1)
    head = HeadPosterior(head_from_options("fedper", "conjugate"), NUM_CLASSES)
    assert isinstance(strategy.head, HeadPosterior) and strategy.head.kind == head.kind
    c = clients[0]
    x = c.data.test_x
    plain = strategy.predict(c.config, c.state, broadcast, x)  # not personalised yet
    assert torch.equal(plain[PREDICTIVE], plain[MAP_PLUGIN])
    assert head.posterior(c.state) is None
    with pytest.raises(ConfigError, match="fitted when the client personalises"):
        head.body_posterior(0, c.state, lambda: pytest.fail("no model needed"))
    personalised = strategy.personalize(c.config, c.state, c.data, broadcast,
                                        torch.Generator().manual_seed(7))
    own = {k: v for k, v in personalised.items() if not k.startswith("head_")}
    assert PERSONALIZED in own  # the network it predicts with, without its head posterior
    model = strategy.client_model(c.config, own)
    fitted = head.fit(own, model, c.data, c.config.client_id)
    assert fitted.keys() == personalised.keys()
    assert all(torch.equal(fitted[k], personalised[k]) for k in fitted)  # same fit, exactly
    got = strategy.predict(c.config, personalised, broadcast, x)
    rows = head.rows(personalised, x, got[MAP_PLUGIN],
                     lambda: strategy.client_model(c.config, personalised))
    assert torch.equal(rows[PREDICTIVE], got[PREDICTIVE])
    expected = head.option.predict(head.posterior(fitted), head_features(model, x))
    assert torch.equal(rows[PREDICTIVE], expected)
    assert not torch.equal(rows[PREDICTIVE], rows[MAP_PLUGIN])  # the head is in use
