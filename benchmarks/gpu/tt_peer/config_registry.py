"""torchtitan 0.3's "1B" Llama 3 flavour (hidden 2048, 16 layers, 32 heads, 8 kv heads, ffn 8192,
vocabulary 128256, tied: our llama3-1b) configured as our 1B step runs: 4 sequences of 2048
tokens a step, the plain cross-entropy (not the chunked wrapper), model and loss compiled, its
default fused AdamW (lr 3e-4, betas 0.9/0.95, weight decay 0.1), no activation checkpointing, no
checkpoints or validation, a log line every step. The tokenizer and the data are local files
peer_torchtitan.py writes (TT_PEER_ASSETS, TT_PEER_DATA); their documents are whole multiples of
the sequence, so torchtitan's per-document (block-causal) mask is the plain causal one.

Written against torchtitan's release/0.3 branch (0.3.0rc1): `Trainer.Config`, `model_registry`,
`HuggingFaceTextDataLoader.Config(dataset, dataset_path)`, `CompileConfig(enable, components)`.
"""

import os

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer


def llama3_1b_peer() -> Trainer.Config:
    spec = model_registry("1B", attn_backend=os.environ.get("TT_PEER_ATTENTION", "flex"))
    return Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        hf_assets_path=os.environ["TT_PEER_ASSETS"],
        model_spec=spec,
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=int(os.environ.get("TT_PEER_BATCH", "4")),
                                seq_len=int(os.environ.get("TT_PEER_SEQ", "2048")),
                                steps=int(os.environ.get("TT_PEER_STEPS", "16"))),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test",
                                                    dataset_path=os.environ["TT_PEER_DATA"]),
        metrics=MetricsProcessor.Config(log_freq=1),
        activation_checkpoint=None,
        compile=CompileConfig(enable=True, components=["model", "loss"]),
    )
