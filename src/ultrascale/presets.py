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
    # Mixtures of experts (docs/moe.md). `tiny-moe` is ours: `tiny` with 8 experts of width 128,
    # two per token, sigmoid scores balanced by the auxiliary-loss-free bias (its rate is ten
    # times DeepSeek-V3's, for a run of 200 steps); it trains on two CPU cores.
    "tiny-moe": dict(
        hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=384,
        vocab_size=256, tie_embeddings=True, rope_theta=10000.0, num_experts=8, experts_top_k=2,
        moe_ffn_hidden_size=128, router="sigmoid", balance="aux_free", bias_update_rate=0.01,
    ),
    "mixtral-8x7b": dict(  # Mixtral 8x7B (46.7B parameters, 12.9B active)
        hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_hidden_size=14336,
        vocab_size=32000, tie_embeddings=False, rope_theta=1000000.0, num_experts=8,
        experts_top_k=2, router="softmax", balance="aux_loss", aux_loss_coeff=0.02,
    ),
    # Qwen3-30B-A3B: 128 experts of 768, 8 per token. Its attention has head_dim 128 (q and o
    # project 2048 <-> 4096); ours is hidden / heads = 64, so q, k, v and o count half their
    # weights (about 0.5B of 30.5B parameters).
    "qwen3-30b-a3b": dict(
        hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, ffn_hidden_size=6144,
        vocab_size=151936, tie_embeddings=False, rope_theta=1000000.0, num_experts=128,
        experts_top_k=8, moe_ffn_hidden_size=768, router="softmax", balance="aux_loss",
        aux_loss_coeff=0.001,
    ),
    # DeepSeek-V3 (671B, 37B active): 3 dense layers, then 256 routed experts of 2048 (8 per
    # token, sigmoid scores, the auxiliary-loss-free bias) and 1 shared expert. Its multi-head
    # latent attention (MLA) is approximated here by multi-head attention of the same width
    # (128 heads of 56): 206M attention weights per layer against MLA's 187M, and k, v kept per
    # head where MLA keeps a 512-wide latent. The estimator and the planner see this shape.
    "deepseek-v3": dict(
        hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128, ffn_hidden_size=18432,
        vocab_size=129280, tie_embeddings=False, rope_theta=10000.0, num_experts=256,
        experts_top_k=8, shared_experts=1, moe_ffn_hidden_size=2048, first_k_dense=3,
        router="sigmoid", balance="aux_free", bias_update_rate=0.001,
    ),
}
