"""TRACE's pure algorithm core: tree arrays, allocation solvers, backup, predictor, advantages,
losses, baselines and simulators. numpy/torch only; no I/O; randomness is passed in.

Import the modules directly (``from trace_core.allocation import allocate_roots``); nothing is
re-exported here so that ``import trace_core.tree`` does not pull in torch.
"""
