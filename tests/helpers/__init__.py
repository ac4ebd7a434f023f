"""Helpers shared by the test modules: prompts, reference runners, the family checks, the tiny
models' configs.

Nothing here is collected as a test; fixtures that wrap these live in `tests/conftest.py`.
"""
