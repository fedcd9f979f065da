"""The ``trace`` command (``cli.app``): the top floor, above the flows it runs.

    deployments, cli -> flows -> tasks -> trace_rl (adapters) -> trace_core

``trace ...`` (the pyproject entry point), ``python -m cli ...`` and ``python -m cli.app ...`` are
the same command.
"""
