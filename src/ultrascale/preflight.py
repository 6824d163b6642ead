"""Everything that can be checked before a process starts, checked before a process starts.

Two kinds of check. The configuration's own (what the engine cannot run, an unimplemented logger)
refuse always. This machine's (the data and tokenizer files, the devices, the cores, the memory)
refuse a launch too, but `ultrascale train --dry-run` only reports them: a config written for an
8-GPU node can be inspected on a laptop.

Nothing here imports torch unless the run may use CUDA (to ask the GPUs' count and memory), FP8
(to ask which recipes the device's scaled matmul runs) or resumes a checkpoint saved with other
model settings (to compare the model's tensor shapes).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ultrascale.config import Config, ConfigError
from ultrascale.devices import available_ram, cuda_device_count, local_cores, uses_cuda
from ultrascale.layout import Layout
from ultrascale.memory.report import size
from ultrascale.rules import precision_violations

GIB = 2**30
# What one CPU rank holds besides the estimator's tensors: the interpreter, torch's libraries,
# gloo's buffers, the tokenized corpus. Measured: a tiny-preset rank of the default run peaks at
# 0.37-0.40 GiB resident (the step lines' `rss`; `ultrascale train --set training.steps=30`,
# torch 2.13 CPU, 2026-11-25), of which the estimator counts 0.06 GiB; rounded up.
CPU_RANK_OVERHEAD = int(0.45 * GIB)
# CPU ranks per core beyond which a local run is refused unless launch.max_local_ranks allows it:
# past that each rank gets a sliver of a core and waits on the others at every collective.
RANKS_PER_CORE = 4


@dataclass
class Report:
    """What the checks found: the problems (each a paragraph naming the key), notes that do not
    stop a run, and the memory estimate with the figure it was compared with."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    memory_line: str = ""
    device: str = "cpu"
    resume_line: str = ""  # what resuming will do (checkpoint/resume.py), one line
    data_line: str = ""  # chat data: conversations, samples, loss tokens, the overlong ones


# ---------------------------------------------------------------------------------------------
# The configuration's own checks.


def config_checks(cfg: Config) -> None:
    from ultrascale.parallel.support import check_supported

    check_supported(cfg)


# ---------------------------------------------------------------------------------------------
# This machine's checks: each raises ConfigError.


def check_device(cfg: Config, cuda: bool) -> None:
    if cfg.device == "cuda" and not cuda_device_count():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=auto or cpu.")


def _check_source(key: str, src: str, text_key: str, text: bool = True) -> None:
    """`text`: the field holds documents (data.format=text), not conversations."""
    if src != "builtin" and not Path(src).exists():
        raise ConfigError(f"{key}={src!r} does not exist. Give a text, JSON-lines or Parquet "
                          "file, a folder of them, a save_to_disk folder, a .bin from `ultrascale "
                          "tokenize`, or data.source=builtin.")
    if src.endswith(".bin"):
        if not Path(src + ".json").is_file():
            raise ConfigError(f"{key}={src!r} has no sidecar {Path(src).name}.json; write "
                              "pre-tokenized data with `ultrascale tokenize`.")
        return
    if src == "builtin":
        return
    from ultrascale.data.corpus import source_files
    try:
        files = source_files(src)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    tables = [f for f in files if f.suffix in (".parquet", ".arrow")]
    if tables:  # the text column, named in the error, before any process starts
        try:
            import pyarrow.parquet as pq
            import pyarrow.ipc  # noqa: F401
        except ImportError:
            raise ConfigError(f"{key}={src!r} holds Parquet or Arrow files, which need pyarrow: "
                              "pip install pyarrow (or pip install -e '.[data]').") from None
        for table in tables:  # (the schemas only: a footer or a header each)
            names = (pq.read_schema(table).names if table.suffix == ".parquet"
                     else _arrow_columns(table))
            if text_key not in names:
                raise ConfigError(f"{key}: {table} has no {text_key!r} column (its columns: "
                                  f"{', '.join(names)}); set data.text_key (data.messages_key "
                                  "for chat data) to the one holding it.")
            if text:
                _check_text_column(key, table, text_key)
    for f in files:
        if f.suffix in (".jsonl", ".json"):
            _check_json_lines(key, f, text_key, text)


def _check_text_column(key: str, table: Path, text_key: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet  # noqa: F401  (the submodule)

    from ultrascale.data.corpus import not_text
    schema = pa.parquet.read_schema(table) if table.suffix == ".parquet" else _arrow_schema(table)
    kind = schema.field(text_key).type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return
    nested = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_struct(kind)
    raise ConfigError(f"{key}: " + not_text(f"{table}: column {text_key!r} is of type {kind}",
                                            nested))


# A JSON-lines file up to this size is read whole before launch (a second or so); a larger one has
# its first record checked here and the rest as the ranks read it (each error names its line).
JSON_LINES_CHECKED_WHOLE = 64 * 2**20


def _check_json_lines(key: str, path: Path, text_key: str, text: bool = True) -> None:
    """The records of a JSON-lines file (every one up to JSON_LINES_CHECKED_WHOLE bytes, else the
    first): JSON, an object, with the text field, text where `text` (the ranks would otherwise
    fail on it after starting)."""
    whole = path.stat().st_size <= JSON_LINES_CHECKED_WHOLE
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{key}: {path}:{n} is not valid JSON ({exc.msg}); a JSON-lines "
                                  "file holds one JSON object per line.") from None
            if not isinstance(record, dict) or text_key not in record:
                fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{key}: {path}:{n} has no {text_key!r} field (its fields: "
                                  f"{fields}); set data.text_key (data.messages_key for chat "
                                  "data) to the field that holds it.")
            if text and record[text_key] is not None:
                from ultrascale.data.corpus import document_text
                try:
                    document_text(f"{path}:{n}", text_key, record[text_key])
                except ValueError as exc:
                    raise ConfigError(f"{key}: {exc}") from None
            if not whole:
                return


def _arrow_columns(path: Path) -> list[str]:
    return _arrow_schema(path).names


def _arrow_schema(path: Path):
    import pyarrow as pa
    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_stream(source).schema
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).schema


def check_data_files(cfg: Config) -> None:
    d = cfg.data
    key = d.messages_key if d.format == "chat" else d.text_key
    for name, src in (("data.source", d.source), ("data.val_source", d.val_source)):
        if src is None:
            continue
        _check_source(name, src, key, text=d.format != "chat")
        if d.document_mask and src.endswith(".bin") and not Path(src + ".docs").is_file():
            raise ConfigError(f"data.document_mask needs the document boundaries of {name}="
                              f"{src!r}, which has no {Path(src).name}.docs: write it again with "
                              "`ultrascale tokenize` (it records them), or set "
                              "data.document_mask=false.")


def check_chat_data(cfg: Config, report: Report) -> None:
    """Chat data rendered, checked and packed as the ranks will (data/chat.py): a tokenizer
    folder without a chat template, a conversation without an assistant turn or with an unknown
    role, one longer than training.seq_len (data.overlong=refuse) are refused here; the header
    line counts conversations, samples, loss tokens and the overlong ones."""
    d, t = cfg.data, cfg.training
    if d.format != "chat":
        return
    from ultrascale.data.chat import ChatDataError, chat_tokenizer, load_chat

    try:
        tok = chat_tokenizer(d.tokenizer)
        train = load_chat(d.source, d, t.seq_len, tok)
        if d.val_fraction:
            train, _ = train.split(d.val_fraction)
        if d.val_source is not None:
            load_chat(d.val_source, d, t.seq_len, tok)
    except (ChatDataError, ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"chat data: {exc}") from None
    report.data_line = train.stats.line(t.seq_len, d.loss_on)
    if len(train) < cfg.global_batch_size:
        raise ConfigError(
            f"The global batch is {cfg.global_batch_size} sequences but the chat data packs into "
            f"{len(train)} samples of training.seq_len={t.seq_len}: every step would repeat "
            "samples. Lower micro_batch_size, grad_accum_steps, dp or seq_len, or give more "
            "conversations.")


def check_tokenizer(cfg: Config) -> None:
    from ultrascale.data.tokenizers import load_tokenizer

    spec = cfg.data.tokenizer
    try:
        tok = load_tokenizer(spec)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # the tokenizers library's parse errors are plain Exceptions
        raise ConfigError(f"data.tokenizer={spec!r} cannot be read as a tokenizer "
                          f"({type(exc).__name__}: {exc}). Give a Hugging Face tokenizer.json "
                          "file or model folder, or data.tokenizer=byte.") from None
    if tok.vocab_size > cfg.model.vocab_size:
        folder = cfg.model.from_hf
        if folder is None:
            raise ConfigError(f"data.tokenizer has {tok.vocab_size} tokens but model.vocab_size="
                              f"{cfg.model.vocab_size}; set model.vocab_size >= "
                              f"{tok.vocab_size}.")
        from ultrascale.hf_arch import tokenizer_file

        # The pretrained embedding has its rows: a larger vocabulary would not fit its weights.
        fix = (f"use the model's own tokenizer: data.tokenizer={folder}"
               if tokenizer_file(folder) is not None else
               f"use the model's own tokenizer (at most {cfg.model.vocab_size} tokens), which "
               f"{folder} does not hold: copy its tokenizer.json there or give its path")
        raise ConfigError(f"data.tokenizer={spec} has {tok.vocab_size} tokens but "
                          f"model.from_hf={folder} embeds {cfg.model.vocab_size} (its "
                          "vocab_size: the rows of its pretrained embedding and head, which "
                          f"model.vocab_size cannot change); {fix}.")


def check_hf_positions(cfg: Config) -> None:
    """model.from_hf: a seq_len beyond the positions its weights were trained on
    (max_position_embeddings) is refused: rotary positions past them degrade the model."""
    folder = cfg.model.from_hf
    if folder is None:
        return
    from ultrascale import hf_arch

    try:
        limit = hf_arch.read_config(folder).get("max_position_embeddings")
    except (hf_arch.HFConfigError, OSError, ValueError):
        return  # check_hf_weights says what is wrong with the folder
    if isinstance(limit, int) and cfg.training.seq_len > limit:
        raise ConfigError(
            f"training.seq_len={cfg.training.seq_len} is longer than model.from_hf={folder} was "
            f"trained for (max_position_embeddings={limit} in its config.json): rotary positions "
            f"beyond it degrade the pretrained model. Set training.seq_len <= {limit}; to extend "
            "its context on purpose, copy the folder and raise max_position_embeddings in its "
            "config.json, with the rope scaling (rope_scaling) or rope_theta the longer context "
            "is to use.")


def check_hf_weights(cfg: Config) -> None:
    """model.from_hf: the folder, its architecture, every shard and every tensor's shape, read
    from the files' headers (no tensor is loaded)."""
    folder = cfg.model.from_hf
    if folder is None:
        return
    from ultrascale import hf_arch
    from ultrascale.checkpoint.hf import check_folder

    try:
        hf_arch.model_keys(folder)  # the architecture, strictly (a resolved config skips it)
        check_folder(cfg.model, folder)
    except hf_arch.HFConfigError as exc:
        raise ConfigError(f"model.from_hf: {exc}") from None


def data_tokens(cfg: Config) -> tuple[int, bool]:
    """Tokens in data.source without tokenizing it: exact for .bin files and for the byte
    tokenizer on text and tables, otherwise an upper bound (one token per byte, and two per
    document for its boundaries)."""
    from ultrascale.data.corpus import builtin_documents, source_files, text_size
    from ultrascale.data.tokenizers import SEPARATOR

    src, exact = cfg.data.source, cfg.data.tokenizer == "byte"
    sep = len(SEPARATOR.encode())
    if src == "builtin":
        return sum(len(d.encode()) + sep for d in builtin_documents()), exact
    if src.endswith(".bin"):
        import json
        return int(json.loads(Path(src + ".json").read_text())["num_tokens"]), True
    total = 0
    for f in source_files(src):
        size, docs, size_exact = text_size(f, cfg.data.text_key)
        total += size + sep * docs
        exact = exact and size_exact
    return total, exact


def check_data_size(cfg: Config) -> None:
    t = cfg.training
    if cfg.data.format == "chat":
        return  # chat data is counted by check_chat_data
    try:
        _check_source("data.source", cfg.data.source, cfg.data.text_key)
    except ConfigError:
        return  # check_data_files says what is wrong; its size would be a wrong diagnosis
    tokens, exact = data_tokens(cfg)
    if cfg.data.val_fraction:  # the held-out tail is not trained on
        tokens = int(tokens * (1 - cfg.data.val_fraction))
    amount = f"{tokens:,} tokens" if exact else f"at most {tokens:,} tokens"
    samples = max(0, (tokens - 1) // t.seq_len)
    if tokens < 3:  # nothing but the document separators: no sequence length can help
        raise ConfigError(
            f"data.source={cfg.data.source!r} holds no text ({amount}). Give a file with text "
            f"in it (or the field data.text_key={cfg.data.text_key!r} filled), or "
            "data.source=builtin.")
    if samples < 1:
        raise ConfigError(
            f"training.seq_len={t.seq_len} is longer than the whole of data.source="
            f"{cfg.data.source!r} ({amount}). Lower training.seq_len to at most {tokens - 1}, or give "
            "more data.")
    if samples < cfg.global_batch_size:
        raise ConfigError(
            f"The global batch is {cfg.global_batch_size} sequences (training.micro_batch_size "
            f"{t.micro_batch_size} x grad_accum_steps {t.grad_accum_steps} x parallel.dp "
            f"{cfg.parallel.dp}) but data.source={cfg.data.source!r} holds {samples} sequences of "
            f"training.seq_len={t.seq_len} ({amount}): every step would repeat samples. Lower "
            "micro_batch_size, grad_accum_steps, dp or seq_len, or give more data.")


def check_resume(cfg: Config, report: Report) -> None:
    """The checkpoint to resume, from its meta.json (files there, tensors complete, the model's
    shapes), the run folder (run_folder.py: a fresh run into a used one refused), and the one line
    saying what differs and how the learning rate continues."""
    from ultrascale import run_folder
    from ultrascale.checkpoint.resume import plan_resume

    plan = plan_resume(cfg)
    run_folder.check(cfg, plan.path if plan else None, plan.step if plan else 0,
                     tuple(p for p, _ in plan.skipped) if plan else ())
    if plan is not None:
        report.resume_line = plan.line
    elif cfg.checkpoint.resume == "auto":
        report.resume_line = (f"resume: auto found no checkpoint in {cfg.checkpoint.dir}: starting "
                              "at step 0")


def check_loggers(cfg: Config) -> None:
    """The packages the asked-for metric sinks need (neither is a requirement of ours)."""
    import importlib.util

    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true needs the tensorboard package: "
                          "pip install tensorboard (or pip install -e '.[tensorboard]').")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb=true needs the wandb package: pip install wandb (or pip "
                          "install -e '.[wandb]'); on a machine without network set "
                          "WANDB_MODE=offline and `wandb sync` the run folder's wandb/ later.")


def check_rank_count(cfg: Config, local_ranks: int, cuda: bool) -> None:
    p = cfg.parallel
    layout = (f"parallel.dp={p.dp} x tp={p.tp} x pp={p.pp} x cp={p.cp} = {local_ranks} "
              f"rank{'s' if local_ranks > 1 else ''}")
    if cuda:
        gpus = cuda_device_count()
        if gpus and local_ranks > gpus:
            raise ConfigError(
                f"{layout} to start on this machine, which has {gpus} GPU(s): every rank needs "
                "its own. Lower the layout, or run on several machines with torchrun or srun "
                "(configs/llama3-70b.sbatch shows how).")
        return
    cores = local_cores()
    limit = cfg.launch.max_local_ranks or RANKS_PER_CORE * cores
    if local_ranks > limit:
        why = ("launch.max_local_ranks" if cfg.launch.max_local_ranks else
               f"{RANKS_PER_CORE} per core, the local limit")
        raise ConfigError(
            f"{layout} to start on this machine's {cores} CPU core(s): more than {limit} "
            f"({why}). Lower parallel.dp (or tp, pp, cp), run on several machines with torchrun "
            "or srun, or raise launch.max_local_ranks to start them anyway.")


def check_precision(cfg: Config, cuda: bool) -> None:
    """fp8: the device's scaled matmul must run the recipe, unless the reference is asked for
    (precision.fp8_emulate). Asked of torch on this machine (a small matmul each way)."""
    if cfg.precision.dtype != "fp8" or cfg.precision.fp8_emulate:
        return
    if cuda and not cuda_device_count():  # check_device says so; no device to ask
        return
    import torch

    from ultrascale.parallel.precision import native_fp8_recipes
    device = torch.device("cuda" if cuda else "cpu")
    broken = precision_violations(cfg.precision, native_fp8_recipes(device),
                                  device=torch.cuda.get_device_name() if cuda else "this CPU")
    if broken:
        raise ConfigError(broken[0].message)


def memory_estimate(cfg: Config, cuda: bool, layout: Layout | None = None):
    from ultrascale.memory.estimator import estimate

    return estimate(cfg.model, layout or cfg.layout(), pp_layers=cfg.parallel.pp_layers)


def _alternatives(cfg: Config, cuda: bool, per_rank) -> list[str]:
    """Changes that shrink the estimate, each with its figure (per_rank: estimate -> bytes)."""
    base = cfg.layout()
    out = []
    tries = []
    if base.recompute != "full":
        tries.append(("training.recompute=full", base.with_(recompute="full")))
    if base.mbs > 1:
        tries.append((f"training.micro_batch_size=1 with grad_accum_steps="
                      f"{base.grad_accum * base.mbs} (the same global batch)",
                      base.with_(mbs=1, grad_accum=base.grad_accum * base.mbs)))
    if base.dp > 1 and base.zero < 3:
        tries.append(("parallel.zero=3", base.with_(zero=3)))
    for cp in (2 * base.cp, 4 * base.cp):  # a long sequence split over more ranks
        if base.seq_len % (2 * cp) == 0:
            tries.append((f"parallel.cp={cp} ({cp // base.cp}x the ranks)", base.with_(cp=cp)))
    for text, layout in tries:
        try:
            est = memory_estimate(cfg, cuda, layout)
        except ValueError:
            continue
        out.append(f"{text}: {size(per_rank(est))}")
    return out


def check_memory(cfg: Config, local_ranks: int, cuda: bool, report: Report) -> None:
    """The estimator's peak per rank against the GPU's memory, or, on CPUs, against the RAM the
    local ranks share. Fills report.memory_line whatever the verdict."""
    from ultrascale.memory.estimator import LayoutError

    try:
        est = memory_estimate(cfg, cuda)
    except LayoutError as exc:
        report.notes.append(f"no memory estimate for this layout: {exc}")
        return
    layout = cfg.layout()
    what = (f"{layout.dtype}, micro-batch {layout.mbs} x {layout.seq_len} tokens, "
            f"recompute {layout.recompute}")
    if cuda:
        import torch

        from ultrascale.planner.hardware import GPU_OUTSIDE_ALLOCATOR

        estimated = (f"{size(est.total)} per GPU at the peak, {size(est.reserved)} with the "
                     f"allocator's fragmentation ({what})")
        if not torch.cuda.is_available():
            report.memory_line = f"{estimated}; no GPU here to compare with"
            return
        device = torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0)))
        usable = device.total_memory - GPU_OUTSIDE_ALLOCATOR
        need = est.reserved
        report.memory_line = (f"{estimated}; the {device.name} leaves {usable / GIB:.1f} GiB (its "
                              f"{device.total_memory / GIB:.1f} GiB less "
                              f"{GPU_OUTSIDE_ALLOCATOR / GIB:.0f} GiB for the CUDA context and NCCL)")
        fits = need <= usable
        per_rank = lambda e: e.reserved  # noqa: E731
        where = f"the {usable / GIB:.1f} GiB a {device.name} leaves"
    else:
        avail = available_ram()
        need = local_ranks * (est.total + CPU_RANK_OVERHEAD)
        report.memory_line = (f"{size(est.total)} per rank estimated ({what}) + "
                              f"{size(CPU_RANK_OVERHEAD)} per process, x {local_ranks} "
                              f"local rank(s) = {size(need)} of {avail / GIB:.1f} GiB "
                              "available RAM")
        fits = need <= avail
        per_rank = lambda e: e.total  # noqa: E731
        where = (f"the RAM its {local_ranks} local rank(s) share: {size(need)} with "
                 f"{size(CPU_RANK_OVERHEAD)} per process, against {avail / GIB:.1f} GiB "
                 "available on this machine")
    budget = cfg.launch.memory_per_rank_gib
    if budget is not None:
        report.memory_line += (f"; launch.memory_per_rank_gib allows {budget:g} GiB per rank, the "
                               f"estimate is {size(per_rank(est))}")
        if per_rank(est) > budget * GIB:
            fits = False
            where = f"launch.memory_per_rank_gib={budget:g} GiB"
    if fits or not cfg.launch.memory_check:
        if not fits:
            report.notes.append("the memory estimate exceeds this machine's memory; starting "
                                "anyway (launch.memory_check=false)")
        return
    fixes = _alternatives(cfg, cuda, per_rank)
    raise ConfigError(
        f"This run would run out of memory: `ultrascale memory` estimates {size(per_rank(est))}"
        f" per rank (model {cfg.model.preset or 'custom'}, {_count(cfg.model.num_params())}"
        f" parameters; {layout.short()}, {layout.dtype}; "
        f"training.seq_len={cfg.training.seq_len}, micro_batch_size="
        f"{cfg.training.micro_batch_size}, recompute={layout.recompute}), more than {where}.\n"
        + ("Fixes, with the estimate per rank each gives:\n" + "".join(f"  {f}\n" for f in fixes)
           if fixes else "")
        + "Or a shorter training.seq_len, more ranks over more devices (`ultrascale plan --config "
          "CONFIG.yaml --gpus N` ranks layouts that fit), or launch.memory_check=false to start "
          "anyway.")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def notes(cfg: Config) -> list[str]:
    """Settings that run but do nothing, said once at start."""
    p, out = cfg.parallel, []
    # ZeRO shards over dp (or the dp_shard group) x cp (parallel/apply.py runs one rank's as 0).
    from ultrascale.theory.data import shard_group

    dp = "dp_shard" if p.dp_shard else "dp"
    if p.zero and shard_group(cfg.layout()) == 1:
        out.append(f"parallel.zero={p.zero} with {dp}=1: there is nothing to shard, so it runs "
                   f"as zero=0 (the same memory and traffic); it takes effect with {dp} or cp "
                   "> 1.")
    return out


def preflight(cfg: Config, local_ranks: int | None = None, *, strict: bool = True,
              count_ranks: bool = True) -> Report:
    """Run every check; strict: raise the first problem as a ConfigError (a launch), else collect
    the machine's problems in the report (--dry-run). local_ranks: the processes this machine
    runs (default: the whole world); count_ranks=False under torchrun/srun, which chose them."""
    config_checks(cfg)  # always refuses
    local_ranks = local_ranks or cfg.parallel.world_size
    cuda = uses_cuda(cfg.device)
    report = Report(notes=notes(cfg), device="cuda" if cuda else "cpu")
    checks = [lambda: check_device(cfg, cuda), lambda: check_precision(cfg, cuda)]
    if count_ranks:
        checks.append(lambda: check_rank_count(cfg, local_ranks, cuda))
    checks += [lambda: check_data_files(cfg), lambda: check_tokenizer(cfg),
               lambda: check_hf_weights(cfg), lambda: check_hf_positions(cfg),
               lambda: check_chat_data(cfg, report),
               lambda: check_data_size(cfg), lambda: check_resume(cfg, report),
               lambda: check_loggers(cfg), lambda: check_memory(cfg, local_ranks, cuda, report)]
    for check in checks:
        try:
            check()
        except ConfigError as exc:
            if strict:
                raise
            report.problems.append(str(exc))
    return report
