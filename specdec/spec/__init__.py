"""Speculative decoding: proposers, verification, the draft-and-verify pipeline, metrics."""
