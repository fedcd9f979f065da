"""``python -m trace_rl.policy.bootstrap --family synth_arith --out DIR``."""

from trace_rl.policy.bootstrap.entry import main

main()
