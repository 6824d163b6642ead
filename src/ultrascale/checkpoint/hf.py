"""Hugging Face checkpoints in and out: `model.from_hf` (import) and `ultrascale export --to-hf`.

Import reads a folder written by `save_pretrained` (config.json, one safetensors file or several
with `model.safetensors.index.json`). Each rank copies into the model it holds after tensor
parallel and the pipeline have shaped it, tensor by tensor, reading only its own slice of each
(safetensors `get_slice`: the rows or columns of a tensor-parallel shard, a stage's layers only),
so that a large model never sits in memory twice. In a run the copy goes where the optimizer
steps the weights, as a checkpoint's restore does (`parallelize`): the fp32 masters of a
bf16/fp16 run, exact whatever the folder's dtype, or ZeRO's shards. The names and the
architecture's features come from `hf_arch.py` (one table entry per architecture). A mixture of
experts' stacked weights `[E, out, in]` are E tensors in the folder (`experts.{j}.w1` /
`gate_proj`, ...): a rank reads only those of the experts it keeps under expert parallel, one
expert at a time.

Export writes config.json (the imported folder's own settings kept where there was one), the
weights in safetensors shards of at most `max_shard_bytes` with their index, a
generation_config.json when the tokenizer's BOS/EOS are known, and the tokenizer's files when the
run had a Hugging Face tokenizer: a folder `transformers.AutoModelForCausalLM.from_pretrained`
loads.

Bad input is refused naming the file or the tensor: a missing shard, a tensor in no shard, a shape
that does not match the config, a tensor the model has no place for. `check_folder` runs the same
checks from the files' headers alone (no tensor is read), before any process starts.
"""

from __future__ import annotations

import json
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ultrascale import hf_arch, hf_export
from ultrascale.config import Config, ConfigError, ModelConfig
from ultrascale.parallel.replicated import Held

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Tensors some checkpoints carry that our model recomputes (old Llama exports kept these).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")


class WeightsError(ConfigError):
    """A Hugging Face folder whose weights do not fit the model, naming the file or tensor."""


# ---------------------------------------------------------------------------------------------
# Where each tensor is


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = {name: folder / f for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise WeightsError(f"{index} lists the shard {f.name}, which is missing from "
                                   f"{folder}: copy the whole folder save_pretrained wrote.")
        return files
    single = folder / SINGLE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    if list(folder.glob("*.bin")) or list(folder.glob("*.pt")):
        raise WeightsError(f"{folder} holds PyTorch pickles (.bin), not safetensors: load it in "
                           "transformers and save_pretrained it again (safetensors is the "
                           "default), so that nothing is unpickled here.")
    raise WeightsError(f"{folder} has neither {SINGLE} nor {INDEX}: give a folder written by "
                       "save_pretrained.")


def expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> its full shape, for a model of this config (no memory used)."""
    from ultrascale.models.llama import Llama

    with torch.device("meta"):
        return {n: tuple(t.shape) for n, t in Llama(model).state_dict().items()}


def _plan(model: ModelConfig, files: dict[str, Path], folder: Path) -> dict[str, list[str]]:
    """Our name -> the Hugging Face names (one, or one per expert), every tensor present;
    refuses what does not fit. Our own buffers that no Hugging Face class holds (the expert
    bias) are left out: they keep their initial value (zero)."""
    names = {}
    for ours in expected_shapes(model):
        if hf_arch.ours_only(ours, model.architecture):
            continue
        try:
            names[ours] = hf_arch.hf_names(ours, model.architecture, model.num_experts,
                                           model.num_layers)
        except KeyError:
            raise WeightsError(f"{folder}: a {model.architecture} folder has no tensor for "
                               f"ultrascale's {ours}: the model.* keys given beside model.from_hf "
                               "describe another model than these weights.") from None
    missing = [(o, h) for o, hs in names.items() for h in hs if h not in files]
    if missing:
        ours, theirs = missing[0]
        more = f" ({len(missing)} tensors missing)" if len(missing) > 1 else ""
        raise WeightsError(f"{folder}: the tensor {theirs} (ultrascale's {ours}) is in none of the "
                           f"safetensors files{more}. Does config.json describe these weights?")
    used = {h for hs in names.values() for h in hs}
    used.update(h for hs in hf_arch.mtp_copies(model).values() for h in hs)
    if model.tie_embeddings:
        used.add(hf_arch.architecture(model.architecture).names["output.weight"])
    extra = sorted(h for h in files if h not in used and not h.endswith(IGNORED_SUFFIXES)
                   and not _unused_mtp(h, model))
    if extra:
        raise WeightsError(f"{files[extra[0]]}: the tensor {extra[0]} has no place in a "
                           f"{model.architecture} model of this config ({len(extra)} such "
                           "tensors); its config.json does not describe these weights.")
    return names


def _unused_mtp(name: str, model: ModelConfig) -> bool:
    """A tensor of DeepSeek-V3's multi-token prediction modules (layers past the last), which a
    model without them leaves out (model.mtp_layers=0: a fine-tune without MTP)."""
    if model.mtp_layers or hf_arch.architecture(model.architecture).deepseek != "v3":
        return False
    parts = name.split(".")
    return name.startswith("model.layers.") and int(parts[2]) >= model.num_layers


def check_folder(model: ModelConfig, folder: str | Path) -> None:
    """Every tensor the model needs, present with the right shape: from the headers alone."""
    folder = Path(folder)
    files = weight_files(folder)
    names = _plan(model, files, folder)
    shapes = expected_shapes(model)
    with ExitStack() as stack:
        handles = {}
        for ours, hf_names in names.items():
            want = shapes[ours][1:] if _stacked(ours, model) else shapes[ours]
            for theirs in hf_names:
                f = files[theirs]
                if f not in handles:
                    handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
                _check_shape(handles[f].get_slice(theirs).get_shape(), want, f, theirs, ours)


def _stacked(ours: str, model: ModelConfig) -> bool:
    """Whether our tensor stacks one Hugging Face tensor per expert along its dim 0."""
    return "{j}" in hf_arch.hf_name(ours, model.architecture, model.num_layers)


def _check_shape(got, want, file: Path, theirs: str, ours: str) -> None:
    if tuple(got) != tuple(want):
        raise WeightsError(f"{file}: the tensor {theirs} has shape {tuple(got)}, but the model "
                           f"of config.json needs {tuple(want)} for it (ultrascale's {ours}).")


# ---------------------------------------------------------------------------------------------
# Import


def _local_slice(handle, theirs: str, ours: str, local: torch.Tensor, tp_plan) -> torch.Tensor:
    """The part of one tensor this rank holds: whole, or its tensor-parallel shard (rows of the
    vocabulary padded with zeros, or an even slice along the split dimension)."""
    sl = handle.get_slice(theirs)
    if tp_plan is None or ours not in tp_plan.split:
        return sl[:]
    dim, true_size = tp_plan.split[ours]
    if true_size is not None:  # the vocabulary: this rank's rows, zero rows of padding after
        v = tp_plan.vocab
        rows = sl[v.start:v.start + v.valid]
        out = torch.zeros(local.shape, dtype=rows.dtype)
        out[:v.valid] = rows
        return out
    n = local.shape[dim]
    lo, hi = tp_plan.rank * n, (tp_plan.rank + 1) * n
    return sl[lo:hi] if dim == 0 else sl[:, lo:hi]


def _expert_slice(sl, ours: str, local: torch.Tensor, tp_plan) -> torch.Tensor:
    """One expert's tensor, or under tensor parallel its slice of the expert's width (our
    stacked dim d is the file tensor's d - 1)."""
    if tp_plan is None or ours not in tp_plan.split:
        return sl[:]
    dim = tp_plan.split[ours][0] - 1
    n = local.shape[dim + 1]
    lo, hi = tp_plan.rank * n, (tp_plan.rank + 1) * n
    return sl[lo:hi] if dim == 0 else sl[:, lo:hi]


def load_pretrained(model, folder: str | Path, tp_plan=None, held=None,
                    ep_rank: int = 0) -> int:
    """Copy the weights of a Hugging Face folder into `model`: a plain `Llama`, or what tensor
    parallel (`tp_plan`), expert parallel and the pipeline left of one on this rank. Each tensor
    is read alone, only the slice this rank holds; of stacked experts, this rank's E / ep (ep rank
    `ep_rank` holds experts ep_rank x E/ep onwards), one expert's tensor at a time. With `held`
    (the data-parallel owner's `held()` pieces) the weights go where its optimizer steps them
    instead of into the module: the fp32 masters of a bf16/fp16 run (which then hold the folder's
    values, not their rounding), ZeRO's shard segments; the owner's `values_loaded()` refreshes
    the parameters after. Returns the number of our tensors copied."""
    folder = Path(folder)
    cfg = model.cfg
    files = weight_files(folder)
    names = _plan(cfg, files, folder)
    shapes = expected_shapes(cfg)
    if held is None:
        held = [Held(n, t, 0, t) for n, t in model.state_dict(keep_vars=True).items()]
    targets: dict[str, list[Held]] = {}
    for h in held:
        if h.name in names:  # not ours alone (the expert bias: kept as initialised)
            targets.setdefault(h.name, []).append(h)
    with ExitStack() as stack, torch.no_grad():
        handles = {}

        def handle(theirs: str):
            f = files[theirs]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt"))
            return f, handles[f]

        for ours, pieces in targets.items():
            param = pieces[0].param
            if _stacked(ours, cfg):
                experts = []
                for j in range(param.shape[0]):  # this rank's experts, one tensor at a time
                    theirs = names[ours][ep_rank * param.shape[0] + j]
                    f, h = handle(theirs)
                    _check_shape(h.get_slice(theirs).get_shape(), shapes[ours][1:], f, theirs,
                                 ours)
                    experts.append(_expert_slice(h.get_slice(theirs), ours, param, tp_plan))
                local = torch.stack(experts)
            else:
                theirs = names[ours][0]
                f, h = handle(theirs)
                _check_shape(h.get_slice(theirs).get_shape(), shapes[ours], f, theirs, ours)
                local = _local_slice(h, theirs, ours, param, tp_plan)
            local = local.reshape(-1)
            for piece in pieces:  # a whole parameter, or a flat range of it (ZeRO)
                piece.value.copy_(local[piece.start:piece.start + piece.value.numel()]
                                  .view_as(piece.value))
    return len(targets)


# ---------------------------------------------------------------------------------------------
# Export


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor alone)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def hf_tensors(model: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
               drop_expert_bias: bool = False) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of `state` (plain-model weights by our names), in the names of
    the class `hf_export.export_class` picks: stacked experts split into one tensor per expert (views,
    no copy), our own buffers left out. A non-zero expert bias changes which experts a token goes
    to, and no Mixtral or Qwen tensor holds it: refused unless `drop_expert_bias`."""
    try:
        arch = hf_arch.ARCHITECTURES[hf_export.export_class(model)].model_type
    except hf_arch.HFConfigError as exc:
        raise ConfigError(f"export: {exc}.") from None
    shapes = expected_shapes(model)
    missing = sorted(set(shapes) - set(state))
    if missing:
        raise ValueError(f"the weights lack {missing[:3]}: not a whole model of this config.")
    tensors = {}
    for ours in shapes:
        t = state[ours].detach().to("cpu", dtype).contiguous()
        if hf_arch.ours_only(ours, arch):
            if t.any() and not drop_expert_bias:
                raise ConfigError(
                    f"export: {ours} (balance: aux_free) is non-zero (largest |bias| "
                    f"{float(t.abs().max()):.4g}): it shifts which experts each token is routed "
                    "to, and a Hugging Face Mixtral or Qwen-MoE has no tensor for it, so the "
                    "exported model would route differently. Give --drop-expert-bias to write "
                    "the weights without it anyway.")
            continue
        theirs = hf_arch.hf_names(ours, arch, model.num_experts, model.num_layers)
        if "{j}" in hf_arch.hf_name(ours, arch, model.num_layers):
            tensors.update({name: t[j] for j, name in enumerate(theirs)})
        else:
            tensors[theirs[0]] = t
    for ours, copies in hf_arch.mtp_copies(model.model_copy(update={"architecture": arch})
                                           ).items():
        for name in copies:  # DeepSeek's MTP layers repeat the embedding and the head
            tensors[name] = tensors[hf_arch.hf_name(ours, arch)].clone()
    return tensors


def export_hf(cfg: Config, state: dict[str, torch.Tensor], out: str | Path, *,
              dtype: torch.dtype = torch.float32, max_shard_bytes: int = 2 * 2**30,
              force: bool = False, drop_expert_bias: bool = False) -> Path:
    """Write `state` (plain-model weights by our names) of a run configured by `cfg` as a
    Hugging Face folder at `out`; returns it."""
    from ultrascale.data.tokenizers import load_tokenizer

    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty; give a new folder, or --force to "
                              "write over it.")
    model = cfg.model
    tensors = hf_tensors(model, state, dtype, drop_expert_bias)
    source = Path(model.from_hf) if model.from_hf else None
    base = None
    if source is not None and (source / "config.json").is_file():
        base = json.loads((source / "config.json").read_text())
    tok_spec = cfg.data.tokenizer
    tokenizer = load_tokenizer(tok_spec) if tok_spec != "byte" and Path(tok_spec).exists() \
        else None
    bos = getattr(tokenizer, "bos_id", None)
    eos = getattr(tokenizer, "eos_id", None)
    config = hf_export.export_config(model, base, max_positions=cfg.training.seq_len, bos_id=bos,
                                   eos_id=eos)
    config["dtype"] = str(dtype).removeprefix("torch.")

    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(tmp / SINGLE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if source is not None and (source / "generation_config.json").is_file():
        shutil.copy2(source / "generation_config.json", tmp / "generation_config.json")
    elif bos is not None or eos is not None:
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": bos, "eos_token_id": eos}, indent=2))
    if tokenizer is not None:
        folder = Path(tok_spec) if Path(tok_spec).is_dir() else Path(tok_spec).parent
        names = TOKENIZER_FILES if Path(tok_spec).is_dir() else (Path(tok_spec).name,)
        for name in names:
            if (folder / name).is_file():
                shutil.copy2(folder / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
    return out
