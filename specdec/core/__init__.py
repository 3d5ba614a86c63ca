"""Core vocabulary: registration, inputs, KV cache, state store, batch processing."""
