"""The one description of sizes the theory reads: the model's (`ModelShape`) and what one rank
holds of one micro-batch (`Shape`), derived in one place (`Shape.of`).

`ModelShape` is the hashable twin of `ModelConfig` (the estimator's caches key on it): the fields
every count needs, and every other field of the config the model came from in `extra`, read as
attributes, so that a new model key (an attention's ranks, a second prediction head) reaches the
theory file that reads it without an edit here. Torch-free.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from math import gcd
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from ultrascale.layout import STORAGE_DTYPE, Layout, storage_bytes


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    num_experts: int = 0
    experts_top_k: int = 0
    shared_experts: int = 0
    moe_ffn_hidden_size: int = 0  # 0: ffn_hidden_size
    first_k_dense: int = 0
    head_dim: int = 0  # 0: hidden_size / num_heads
    attention_bias: bool = False
    qk_norm: bool = False
    shared_expert_gate: bool = False
    # Every other (hashable) field of the config, as (name, value) pairs: read as attributes.
    extra: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        # The config's other keys read as plain attributes (not fields: equality and the hash
        # are the fields'), and the hash taken once: the estimator's caches key on the shape for
        # every layout the planner ranks.
        self.__dict__.update(self.extra)
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in _FIELD_ORDER)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # Rebuilt by its constructor (a string's hash differs from process to process).
        return ModelShape, tuple(getattr(self, f) for f in _FIELD_ORDER)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are neither fields nor the config's other keys.
        raise AttributeError(f"ModelShape has no field {name!r}")


_FIELD_ORDER = tuple(ModelShape.__dataclass_fields__)
_FIELDS = frozenset(_FIELD_ORDER)
_EXTRA_NAMES: dict[type, tuple[str, ...]] = {}


def _extra(model) -> tuple[tuple[str, Any], ...]:
    """The config's fields that ModelShape does not name, those of a plain (hashable) type."""
    kind = type(model)
    names = _EXTRA_NAMES.get(kind)
    if names is None:
        names = _EXTRA_NAMES[kind] = tuple(
            name for name, info in getattr(kind, "model_fields", {}).items()
            if name not in _FIELDS and _plain(info.annotation))
    if not names:
        return ()
    values = map(vars(model).__getitem__, names)
    return tuple(zip(names, (tuple(v) if isinstance(v, list) else v for v in values)))


def _plain(annotation) -> bool:
    """Whether a field's values are plain (numbers, strings, a literal, None, a list of them,
    kept as a tuple): hashable."""
    if annotation in (int, float, str, bool, type(None)):
        return True
    origin = get_origin(annotation)
    if origin is Literal:
        return True
    if origin in (list, tuple):
        return all(a is Ellipsis or _plain(a) for a in get_args(annotation))
    return origin in (Union, UnionType) and all(_plain(a) for a in get_args(annotation))


def model_shape(model) -> ModelShape:
    """The shape of a `ModelConfig` (or anything with its field names) as a hashable key: the
    same object again for the same config while its values stay the same (the planner asks for
    every layout it ranks)."""
    if isinstance(model, ModelShape):
        return model
    # A config (pydantic: its values in its __dict__) is looked up by identity and values.
    values = vars(model) if hasattr(type(model), "model_fields") else None
    known = _SHAPES.get(id(model))
    if known is not None and known[0] is model and known[1] == values:
        return known[2]
    shape = ModelShape(model.hidden_size, model.num_layers, model.num_heads,
                       model.num_kv_heads or model.num_heads, model.ffn_hidden_size,
                       model.vocab_size, bool(model.tie_embeddings), model.num_experts,
                       model.experts_top_k, model.shared_experts,
                       getattr(model, "moe_ffn_hidden_size", 0),
                       getattr(model, "first_k_dense", 0), getattr(model, "head_dim", 0),
                       bool(getattr(model, "attention_bias", False)),
                       bool(getattr(model, "qk_norm", False)),
                       bool(getattr(model, "shared_expert_gate", False)), _extra(model))
    if values is not None:
        if len(_SHAPES) >= 64:
            _SHAPES.clear()
        # A copy of its values: a config changed since is read anew. (The shape reads only its
        # top-level plain values, so a shallow copy tells.)
        _SHAPES[id(model)] = (model, dict(values), shape)
    return shape


# id(config) -> (the config, its values then, its shape)
_SHAPES: dict[int, tuple[Any, dict, ModelShape]] = {}


def make_frozen(cls: type, values: dict) -> Any:
    """An instance of the frozen dataclass `cls` (without a `__post_init__`), as `cls(**values)`
    makes it (fields left out at their defaults), without the generated `__init__`'s
    `object.__setattr__` per field: the folds make a few per layout, the planner thousands of
    layouts."""
    obj = object.__new__(cls)
    state = obj.__dict__
    state.update(_defaults(cls))
    state.update(values)
    return obj


_DEFAULTS: dict[type, dict[str, Any]] = {}


def _defaults(cls: type) -> dict[str, Any]:
    found = _DEFAULTS.get(cls)
    if found is None:
        found = _DEFAULTS[cls] = {f.name: f.default for f in fields(cls)
                                  if f.default is not MISSING}
    return found


@dataclass(frozen=True)
class Shape:
    """What one rank holds of one micro-batch through one layer: the sizes already divided by
    tp / cp / ep. The memory counts read the integers; the step time reads `tokens` (the rows of
    the rank's GEMMs) and divides the model's widths (`model`) by tp itself."""

    b: int  # micro-batch size
    s: int  # tokens per sequence held by this rank (seq_len / cp)
    s_kv: int  # keys each query attends to at most (the full seq_len)
    h: int  # hidden size
    heads: int  # query heads on this rank (num_heads / tp)
    kv: int  # key/value width on this rank (num_kv_heads * head_dim / tp)
    head_dim: int
    f: int  # MLP width on this rank (ffn_hidden_size / tp)
    tp: int
    sp: bool  # sequence parallel: norms and residuals split over tp
    act: int  # bytes per activation element (the storage dtype)
    # Mixture of experts: routed copies of each token (top_k) and experts on this rank (f is then
    # each expert's width).
    top_k: int = 0
    experts: int = 0
    shared_experts: int = 0
    shared_gate: bool = False  # the shared experts' output scaled by a per-token sigmoid gate
    vocab: int = 0  # vocabulary on this rank (vocab_size / tp)
    ep: int = 1  # expert-parallel ranks (the router scores all experts_on_rank x ep)
    # Key/value width the attention core keeps, when it differs from `kv` (Ulysses replicates kv
    # heads up to a multiple of cp; 0: kv).
    attn_kv: int = 0
    # The attention's output reaches the output projection as a copy (Ulysses sends it back to the
    # sequence split), whatever the implementation's rule.
    output_copy: bool = False
    tokens: float = 0.0  # micro-batch x seq_len / cp: the rows of the rank's GEMMs
    dtype: str = "bf16"  # the blocks' matmuls (fp8: quantised inputs, fp8 rates)
    # What the sizes were derived from: a theory that needs more of them (another attention's
    # ranks) reads them here.
    model: ModelShape | None = None
    layout: Layout | None = None

    @property
    def sp_div(self) -> int:
        """tp when sequence parallel shards norms and residuals, else 1."""
        return self.tp if self.sp else 1

    @property
    def store(self) -> str:
        """The dtype of activations, parameters and everything but the blocks' matmuls (bf16
        under fp8: layout.STORAGE_DTYPE)."""
        return STORAGE_DTYPE[self.dtype]

    @classmethod
    def of(cls, m: ModelShape, lay: Layout, moe: bool = True) -> "Shape":
        """The sizes of an MoE layer of an MoE model (moe=False, or a dense model: of a layer
        with the dense MLP)."""
        tp, cp = lay.tp, lay.cp
        experts = m.num_experts if moe else 0
        return make_frozen(cls, dict(
            b=lay.mbs, s=lay.seq_len // cp, s_kv=lay.seq_len, h=m.hidden_size,
            heads=m.num_heads // tp, kv=max(m.num_kv_heads // tp, 1) * m.head_dim,
            head_dim=m.head_dim, f=((m.moe_ffn_hidden_size or m.ffn_hidden_size) if experts else m.ffn_hidden_size) // tp, tp=tp,
            sp=lay.sequence_parallel and tp > 1, act=storage_bytes(lay.dtype),
            top_k=m.experts_top_k if experts else 0, experts=experts // lay.ep if experts else 0,
            shared_experts=m.shared_experts if experts else 0,
            shared_gate=bool(experts and m.shared_expert_gate), vocab=-(-m.vocab_size // tp),
            ep=lay.ep if experts else 1,
            attn_kv=ulysses_kv(m, lay), output_copy=lay.cp > 1 and lay.cp_mode == "ulysses",
            tokens=lay.mbs * lay.seq_len / lay.cp, dtype=lay.dtype, model=m, layout=lay,
        ))


def ulysses_kv(m: ModelShape, lay: Layout) -> int:
    """Key/value width Ulysses attention keeps: the kv heads of a tp rank replicated up to a
    multiple of cp when cp does not divide them (parallel/context.py); 0 when nothing changes."""
    if lay.cp == 1 or lay.cp_mode != "ulysses":
        return 0
    local = max(m.num_kv_heads // lay.tp, 1)
    return 0 if local % lay.cp == 0 else local * lay.cp // gcd(local, lay.cp) * m.head_dim
