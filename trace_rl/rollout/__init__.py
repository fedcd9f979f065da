"""Multi-turn ReAct rollouts: shared types, the turn format, the loop, the ledger."""
