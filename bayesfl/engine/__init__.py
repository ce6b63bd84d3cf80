"""The round engine: what every transport of a run shares.

* :mod:`~bayesfl.engine.rounds`: the one round loop (:class:`~bayesfl.engine.rounds.RoundLoop`)
  every transport runs, with its ``"inline"`` and ``"carried"`` evaluation modes;
* :mod:`~bayesfl.engine.setup`: the clients' data, the strategy context, client sampling and
  novel clients, from the run configuration alone;
* :mod:`~bayesfl.engine.steps`: screening uploads, aggregate-or-keep, evaluate-or-revert, the
  summary;
* :mod:`~bayesfl.engine.state`: the one checkpoint format;
* :mod:`~bayesfl.engine.channel`: the channel a transport implements (``send``, ``collect``,
  ``close``) and the steps and replies that cross it.

The simulator (:mod:`bayesfl.simulate`, inline) and the Flower ServerApp
(:mod:`bayesfl.flower.server_app`, carried) run their rounds with the one loop, each through
its own channel and hooks; neither imports the other.
"""
