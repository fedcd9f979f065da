"""TRACE adapters: rollout engines, environments, storage, policy and CLI.

These sit beside ``tasks/`` (docs/architecture.md): ``trace_core`` stays pure, and everything that
touches a model, a tool, a file or a server lives here, behind small protocols.
"""
