"""Speculative decoding: draft proposers and the verification of draft tokens."""
