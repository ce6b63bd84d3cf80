"""The round engine: what every transport of a run shares.

* `run`: the whole run (`Run`: setup, resume,
  the rounds, the final evaluation, the summary, calibrate and conformal, the files), which
  each transport subclasses with its channel and a few hooks;
* `rounds`: the one round loop (`RoundLoop`)
  every transport runs, with its ``"inline"`` and ``"carried"`` evaluation modes;
* `setup`: the clients' data, the strategy context, client sampling and
  novel clients, from the run configuration alone;
* `steps`: screening uploads, aggregate-or-keep, evaluate-or-revert, the
  summary;
* `state`: the one checkpoint format;
* `channel`: the channel a transport implements (``send``, ``collect``,
  ``close``) and the steps and replies that cross it.

The simulator (`bayesfl.simulate`, inline) and the Flower ServerApp
(`bayesfl.flower.server_app`, carried) are each a `Run` with
its own channel and hooks; neither imports the other.
"""
