"""The round engine: what every transport of a run shares.

* :mod:`~bayesfl.engine.run`: the whole run (:class:`~bayesfl.engine.run.Run`: setup, resume,
  the rounds, the final evaluation, the summary, calibrate and conformal, the files), which
  each transport subclasses with its channel and a few hooks;
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
(:mod:`bayesfl.flower.server_app`, carried) are each a :class:`~bayesfl.engine.run.Run` with
its own channel and hooks; neither imports the other.
"""
