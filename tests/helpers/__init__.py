"""Helpers shared by the test modules: prompts, reference runners, per-family checks.

Nothing here is collected as a test; fixtures that wrap these live in `tests/conftest.py`.
"""
