"""The cluster's decisions as pure functions and classes over plain dataclasses: routing, admission,
liveness, overload, drop / restore planning, transition planning, request scheduling, token budgets,
microbatching and the cost models behind them.

Nothing here imports protobuf, grpc, torch or a service (tests/unit/policy/test_purity.py fails if one
does): time, stats and layouts come in as arguments and decisions go out as data, so the services, the
unit tests and a simulator run the same code. The services convert wire messages at their edge
(`kunserve.shared.wire`).
"""
