"""`ultrascale export` and `ultrascale generate`: what to do with a checkpoint, whatever its layout.

    ultrascale export runs/<run>/checkpoints/step_00000200 --to-hf hf-out
    ultrascale generate runs/<run>/checkpoints/step_00000200 --prompt "The " --max-new-tokens 80

Both gather the plain model's weights first (`gather.plain_state`: the checkpoint's own layout,
started on this machine's CPUs).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ultrascale.config import ConfigError


def register(subparsers) -> None:
    exp = subparsers.add_parser(
        "export", help="write a checkpoint as a Hugging Face folder (transformers loads it)",
        description="Write a checkpoint of any layout as a Hugging Face model folder: "
                    "config.json, safetensors shards with their index, generation_config.json "
                    "and the tokenizer's files when the run had a Hugging Face tokenizer.")
    exp.add_argument("checkpoint", help="a step_XXXXXXXX folder written by `ultrascale train`")
    exp.add_argument("--to-hf", required=True, metavar="OUT", help="the folder to write")
    exp.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="the weights' dtype in the files (default float32, as trained)")
    exp.add_argument("--max-shard-gb", type=float, default=2.0,
                     help="largest safetensors file, GB (default 2)")
    exp.add_argument("--force", action="store_true", help="write over a non-empty OUT")
    exp.add_argument("--drop-expert-bias", action="store_true",
                     help="write a run balanced with model.balance=aux_free although its expert "
                          "bias is non-zero (Hugging Face's Mixtral and Qwen-MoE have no place "
                          "for it: the exported model then routes without it)")
    exp.set_defaults(func=run_export)

    gen = subparsers.add_parser(
        "generate", help="sample text from a checkpoint, whatever its layout",
        description="Sample from a checkpoint (top-k sampling): the same weights, prompt and "
                    "seed give the same text, whichever layout wrote the checkpoint.")
    gen.add_argument("checkpoint", help="a step_XXXXXXXX folder written by `ultrascale train`")
    gen.add_argument("--prompt", default="The ", help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=100)
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling seed (default: the run's training.seed)")
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-k", type=int, default=20)
    gen.set_defaults(func=run_generate)


def run_export(args) -> int:
    import torch

    from ultrascale.checkpoint.gather import plain_state
    from ultrascale.checkpoint.hf import export_hf

    out = Path(args.to_hf)
    if out.exists() and any(out.iterdir()) and not args.force:  # before the gather, not after
        raise ConfigError(f"--to-hf {out} exists and is not empty; give a new folder, or --force.")
    cfg, state = plain_state(args.checkpoint)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    written = export_hf(cfg, state, out, dtype=dtype,
                        max_shard_bytes=int(args.max_shard_gb * 1e9), force=True,
                        drop_expert_bias=args.drop_expert_bias)
    files = sorted(p.name for p in written.iterdir())
    print(f"wrote {written}: {', '.join(files)}")
    if cfg.data.tokenizer == "byte":
        print("note: the run used the byte tokenizer, which has no Hugging Face files: token id "
              "i is byte i (decode with bytes(ids)).")
    return 0


def run_generate(args) -> int:
    from ultrascale.checkpoint.gather import plain_state
    from ultrascale.data.tokenizers import load_tokenizer
    from ultrascale.models.llama import Llama
    from ultrascale.train.generate import generate

    if args.max_new_tokens < 1 or args.top_k < 1 or args.temperature <= 0:
        raise ConfigError("--max-new-tokens and --top-k must be at least 1, --temperature above 0.")
    cfg, state = plain_state(args.checkpoint)
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    except FileNotFoundError as exc:
        raise ConfigError(f"the run's tokenizer is gone: {exc}") from None
    model = Llama(cfg.model)
    model.load_state_dict(state)
    seed = cfg.training.seed if args.seed is None else args.seed
    text = generate(model, tokenizer, args.prompt, args.max_new_tokens,
                    context=cfg.training.seq_len, seed=seed, temperature=args.temperature,
                    top_k=args.top_k)
    sys.stdout.write(text + "\n")
    return 0
