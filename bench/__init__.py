"""Benchmarks that measure and print figures (not pass/fail timing tests)."""
