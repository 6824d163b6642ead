"""The Python API (docs/api.md): a trained model as a plain module on one process, and the
memory estimate and the plan as functions, without the command line.

    from ultrascale import api
    model = api.load("runs/a")                              # newest checkpoint, any layout
    model = api.load("models/Qwen2.5-0.5B")                 # a Hugging Face folder
    text = api.generate(model, api.tokenizer("runs/a"), "The ", max_new_tokens=40)
    est = api.estimate_memory("llama3-8b", dp=8, zero=1, gpu="h100")
    result = api.plan("llama3-8b", gpus=64, gpu="h100", global_batch_tokens="4M")

Each imports what it needs when called: importing this module is as cheap as the CLI's start.
(The package's __init__ does not import it: the import graph keeps the torch-free modules, whose
packages' __init__ run on the way, from reaching torch through it.)
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["estimate_memory", "generate", "load", "plan", "tokenizer"]


def _checkpoint(path: Path) -> Path | None:
    """The checkpoint folder `path` names: itself, or the newest in a run folder or a checkpoint
    folder; None when it is not a checkpoint (a Hugging Face folder, say)."""
    from ultrascale.checkpoint.index import META, find_latest

    if (path / META).is_file():
        return path
    for folder in (path / "checkpoints", path):
        latest = find_latest(folder)
        if latest is not None:
            return latest
    return None


def load(path: str | Path, *, dtype=None, device: str = "cpu"):
    """A plain `ultrascale.models.llama.Llama` (a torch.nn.Module, in eval mode) with the weights
    of `path`: a checkpoint written by `ultrascale train` in any layout (a `step_XXXXXXXX` folder,
    or a run folder or its `checkpoints/`: the newest), or a Hugging Face folder (config.json and
    safetensors). `model.cfg` is its `ModelConfig`; `model(tokens)` gives logits [batch, seq,
    vocab]. Weights in fp32 (a checkpoint holds the fp32 masters) unless `dtype` is given."""
    import torch

    from ultrascale.config import ConfigError, build_config
    from ultrascale.models.llama import Llama

    path = Path(path)
    checkpoint = _checkpoint(path)
    if checkpoint is not None:
        from ultrascale.checkpoint.gather import plain_state

        cfg, state = plain_state(checkpoint)
        model = Llama(cfg.model)
        model.load_state_dict(state)
    elif (path / "config.json").is_file():
        from ultrascale.checkpoint.hf import load_pretrained

        model = Llama(build_config({"model": {"from_hf": str(path)}}).model)
        load_pretrained(model, path)
    else:
        raise ConfigError(f"{path} holds neither a checkpoint of `ultrascale train` (a "
                          "step_XXXXXXXX folder with meta.json, or a run folder with checkpoints/) "
                          "nor a Hugging Face model (config.json and safetensors).")
    return model.to(device=device, dtype=dtype or torch.float32).eval()


def tokenizer(path: str | Path = "byte"):
    """The tokenizer of a checkpoint or run folder (the one it trained with), of a Hugging Face
    folder or tokenizer.json, or `byte`: `.encode(text)`, `.decode(ids)`, `.vocab_size`."""
    from ultrascale.data.tokenizers import load_tokenizer

    spec = str(path)
    if spec != "byte":
        checkpoint = _checkpoint(Path(path))
        if checkpoint is not None:
            from ultrascale.checkpoint.gather import checkpoint_config

            spec = checkpoint_config(checkpoint).data.tokenizer
    return load_tokenizer(spec)


def generate(model, tok, prompt: str, max_new_tokens: int = 100, *, seed: int = 0,
             temperature: float = 0.8, top_k: int = 20, context: int | None = None) -> str:
    """Continue `prompt` by top-k sampling (the same model, prompt and seed give the same text);
    `context`: the tokens the model sees (default: the whole text so far)."""
    from ultrascale.train.generate import generate as sample

    return sample(model, tok, prompt, max_new_tokens, context=context or 1 << 30, seed=seed,
                  temperature=temperature, top_k=top_k)


def _model_config(model):
    """A ModelConfig from a preset name, a Hugging Face config.json (or its folder) or itself."""
    from ultrascale.config import ModelConfig

    if isinstance(model, ModelConfig):
        return model
    if Path(str(model)).exists():
        from ultrascale.memory.hf import from_hf_config

        return from_hf_config(str(model))
    return ModelConfig(preset=str(model))


def estimate_memory(model="llama3-8b", *, gpu: str | None = None,
                    device_memory: int | None = None, runtime: str = "ultrascale",
                    headroom: float = 0.0, **layout):
    """`ultrascale memory` as a function: the per-device `MemoryEstimate` (bytes: `.total`,
    `.params`, `.grads`, `.optimizer`, `.activations`, ...; `.fits` given a device) of `model`
    (a preset name, a Hugging Face config.json or its folder, or a ModelConfig) under `layout`
    (the `Layout` fields: dp, tp, pp, cp, ep, zero, mbs, grad_accum, seq_len, recompute, dtype,
    ...). `gpu` names a device profile (h100, ...) whose memory less the CUDA context's gives the
    verdict; `device_memory` gives it in bytes instead; `headroom`: the fraction of it kept free."""
    from ultrascale.layout import Layout
    from ultrascale.memory.estimator import estimate

    if gpu is not None and device_memory is None:
        from ultrascale.memory.command import gpu_memory

        device_memory, _ = gpu_memory(gpu)
    return estimate(_model_config(model), Layout(**layout), device_memory=device_memory,
                    runtime=runtime, headroom=headroom)


def plan(model="llama3-8b", *, gpus: int, gpu: str = "h100",
         global_batch_tokens: int | str = "1M", seq_len: int = 4096, top: int | None = 5,
         **search):
    """`ultrascale plan` as a function: the `Plan` of `model` (as `memory` takes it) on `gpus`
    devices of profile `gpu` (or "local", or a YAML profile path): `.ranked` (the fitting layouts,
    fastest first, each a `Prediction` with `.layout`, `.step_time_s`, `.mfu`, `.memory_bytes`,
    `.breakdown`), `.best`, `.why`, `.same_time`, `.advice` when nothing fits. `search` narrows
    the search as `SearchSpace`'s fields do (tp=[1, 2], zero=[1], dtype="fp8", ...)."""
    from ultrascale.planner.command import parse_tokens
    from ultrascale.planner.hardware import get_hardware
    from ultrascale.planner.search import SearchSpace, plan as search_plan

    tokens = parse_tokens(str(global_batch_tokens))
    return search_plan(_model_config(model), gpus, tokens, get_hardware(gpu), seq_len=seq_len,
                       top=top, space=SearchSpace(**_listed(search)))


def _listed(search: dict) -> dict:
    """The search's values with one value where a list is meant (tp=2) made a list of it."""
    from dataclasses import fields

    from ultrascale.planner.search import SearchSpace

    lists = {f.name for f in fields(SearchSpace) if str(f.type).startswith("list[")}
    return {k: [v] if k in lists and isinstance(v, (int, str)) else v
            for k, v in search.items()}
