"""FedSI with ``head=KIND``: after personalisation each client fits ``inference.fit_head(KIND)``
on its features of the global body (zero-centred prior: FedSI's head is personal), predicts
with that posterior's predictive and reports the network's plug-in beside it; without ``head``
the subnet GLM predictive stays."""

import pytest
import torch
from strategy_helpers import NUM_CLASSES, evaluation_broadcast, run_round

import inference
from bayesfl.errors import ConfigError
from bayesfl.strategies import MAP_PLUGIN, PREDICTIVE
from bayesfl.strategies.probabilistic_head import PREDICTIVE_METHODS


def personalised(build, **options):
    strategy, clients, state = build("fedsi", **options)
    state, _ = run_round(strategy, clients, state, 1)
    broadcast = evaluation_broadcast(strategy, state, 1)
    c = clients[1]
    mine = strategy.personalize(c.config, c.state, c.data, broadcast,
                                torch.Generator().manual_seed(7))
    return strategy, c, mine, broadcast


def body_features(strategy, config, state, x):
    model = strategy.client_model(config, state).eval()
    with torch.no_grad():
        return model.body(x).double()


@pytest.mark.parametrize("kind", ["laplace", "conjugate"])
def test_the_predictive_is_fit_head_on_the_personalised_features(build, kind):
    strategy, c, state, broadcast = personalised(build, head=kind)
    post = inference.fit_head(kind, body_features(strategy, c.config, state, c.data.train_x),
                              c.data.train_y, NUM_CLASSES, threads=torch.get_num_threads())
    expected = post.predict_proba(body_features(strategy, c.config, state, c.data.test_x),
                                  method=PREDICTIVE_METHODS[kind])
    got = strategy.predict(c.config, state, broadcast, c.data.test_x)
    torch.testing.assert_close(got[PREDICTIVE], expected.double(), rtol=0, atol=0)
    # the plug-in beside it is the personalised network's softmax (body at the global mean,
    # fine-tuned head): the same as without a head
    model = strategy.client_model(c.config, state).eval()
    with torch.no_grad():
        plugin = torch.softmax(model(c.data.test_x).double(), 1)
    torch.testing.assert_close(got[MAP_PLUGIN], plugin, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got[PREDICTIVE], got[MAP_PLUGIN], atol=1e-3)
    # the client's posterior object is the head's, behind its body
    client_post = strategy.posterior(c.config, state, broadcast)
    torch.testing.assert_close(client_post.predict_proba(c.data.test_x), got[PREDICTIVE],
                               rtol=0, atol=0)


def test_without_head_the_predictive_is_the_subnet_glm(build):
    strategy, c, state, broadcast = personalised(build)
    got = strategy.predict(c.config, state, broadcast, c.data.test_x)[PREDICTIVE]
    subnet = strategy.personal_posterior(c.config, state)
    torch.testing.assert_close(got, subnet.predict_proba(c.data.test_x, "glm_probit").double())
    assert not any(k.startswith("head_posterior.") for k in state)


@pytest.mark.parametrize(("options", "message"), [
    ({"head": "gaussian"}, "fedsi head must be one of"),
    ({"head_options": {"structure": "full"}}, "fedsi head_options need a head"),
    ({"head": "laplace", "head_options": {"n_samples": 3}}, "takes no option 'n_samples'"),
])
def test_bad_head_options_are_config_errors(build, options, message):
    with pytest.raises(ConfigError, match=message):
        build("fedsi", **options)
