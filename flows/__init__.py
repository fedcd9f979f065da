"""Prefect flows: the control loop of TRACE, as named phases (DESIGN.md section 2)."""
