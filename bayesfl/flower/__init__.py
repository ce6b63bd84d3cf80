"""Run any bayesfl strategy on Flower (flwr), the federated-learning engine for real devices.

The only package of bayesfl that imports ``flwr`` (install the extra: ``pip install
'bayesfl[flower]'``). `server_app` is a ``ServerApp`` that drives a
strategy's server half over Flower's ``Grid``; `client_app` is a
``ClientApp`` that runs the client half on each SuperNode's own partition;
`protocol` is what they say to each other (bayesfl messages as bytes inside
Flower records) and how Flower's run config maps to a bayesfl configuration;
`local` starts a SuperLink and SuperNodes on 127.0.0.1 and runs an
experiment end to end (``bayesfl flower``). The app a user copies is ``examples/flower_app``.
"""
