"""Measurements of the test suite itself (docs/results/suite_timings.md)."""
