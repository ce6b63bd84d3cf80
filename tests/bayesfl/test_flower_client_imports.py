"""A Flower ClientApp process imports only what a client step needs: Flower starts one per
message, so every module it loads is paid at every message (issue 28)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("flwr")

ROOT = Path(__file__).resolve().parents[2]

RUN_CONFIG = {"strategy": "fedlog", "dataset": "digits", "clients": 3, "partition": "iid",
              "rounds": 2, "seed": 0, "local-epochs": 1, "threads": 1}

HEAVY = ("torch._dynamo", "sympy", "scipy", "sklearn", "pandas", "matplotlib", "pyro",
         "laplace")
"""Modules a FedLog client step does not need, each 0.5-3 s to import: torch.optim's first
step (torch._dynamo, sympy), scipy's optimisers, scikit-learn and pandas (the digits data set
ships as arrays), plotting, the MFVI and Laplace stacks."""


def test_a_fedlog_round_step_in_a_fresh_process_imports_nothing_heavy(tmp_path):
    from flwr.app import Context, RecordDict

    from bayesfl.flower import client_app
    from bayesfl.messages import encode
    from bayesfl.strategies import make_strategy
    from bayesfl.strategies.halves import server_half

    context = Context(run_id=1, node_id=100, node_config={"partition-id": 0,
                                                          "num-partitions": 3},
                      state=RecordDict(), run_config=RUN_CONFIG)
    node = client_app.node_of(context)  # it holds the client half only: the server half is
    server = server_half(make_strategy(  # built here from the same run, not in the child
        node.config.strategy, node.strategy.context, **node.config.strategy_options))
    broadcast = tmp_path / "broadcast.bin"
    broadcast.write_bytes(encode(server.configure(server.init(), 1).broadcast))
    code = textwrap.dedent(f"""
        import json, sys
        import flwr.supernode.cli  # what flwr-clientapp has imported before it loads the app
        from flwr.app import Context, Message, RecordDict
        from flwr.supercore.task_identity import TaskIdentity
        for key in ("_run_id", "_node_id", "_task_id"):  # what a ClientApp process has set
            setattr(TaskIdentity, key, 1)
        from bayesfl.flower import client_app
        from bayesfl.flower.protocol import ROUND, pack, record_values
        context = Context(run_id=1, node_id=100,
                          node_config={{"partition-id": 0, "num-partitions": 3}},
                          state=RecordDict(), run_config={RUN_CONFIG!r})
        fit = open({str(broadcast)!r}, "rb").read()
        message = Message(pack(round=1, fit=fit, personalize=False, final=False),
                          dst_node_id=100, message_type=ROUND)
        reply = client_app.round_step(message, context)
        print(json.dumps({{"upload": "upload" in record_values(reply.content),
                          "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"upload": True, "heavy": []}
