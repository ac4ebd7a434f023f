"""Tests of the entrypoints (the OpenAI-compatible server)."""
