"""Published model shapes. A preset only supplies defaults: explicit `model.*` keys override them."""

from __future__ import annotations

# Llama 3.x shapes as published by Meta (config.json of each release). `tiny` is ours: small enough
# to train on two CPU cores in a couple of minutes, with a byte-level vocabulary.
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=384,
        vocab_size=256, tie_embeddings=True, rope_theta=10000.0,
    ),
    "llama3-1b": dict(  # Llama 3.2 1B
        hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_hidden_size=8192,
        vocab_size=128256, tie_embeddings=True, rope_theta=500000.0,
    ),
    "llama3-3b": dict(  # Llama 3.2 3B
        hidden_size=3072, num_layers=28, num_heads=24, num_kv_heads=8, ffn_hidden_size=8192,
        vocab_size=128256, tie_embeddings=True, rope_theta=500000.0,
    ),
    "llama3-8b": dict(  # Llama 3.1 8B
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
        vocab_size=128256, tie_embeddings=False, rope_theta=500000.0,
    ),
    "llama3-70b": dict(  # Llama 3.1 70B
        hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, ffn_hidden_size=28672,
        vocab_size=128256, tie_embeddings=False, rope_theta=500000.0,
    ),
    "llama3-405b": dict(  # Llama 3.1 405B
        hidden_size=16384, num_layers=126, num_heads=128, num_kv_heads=8, ffn_hidden_size=53248,
        vocab_size=128256, tie_embeddings=False, rope_theta=500000.0,
    ),
}
