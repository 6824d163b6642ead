"""How a configuration key is declared (`key(...)` in config_model.py and config_sections.py),
and everything read back from the declarations: the dotted names, the meanings, the layout roles,
the choices, the names other trainers use, and the one-paragraph explanation of a validation error.

Torch-free and free of the config tree itself (the config modules import this, never the other
way round): each reader takes the tree's root class. `Section` is every section's base.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """An invalid configuration, explained in one paragraph: what is wrong and how to fix it."""


class Section(BaseModel):
    """A section of the tree (or the root): an unknown key is an error, not ignored."""

    # inf and nan are refused in every float key (a learning rate of inf would start training).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def key(default: Any, meaning: str, *, layout: str | None = None,
        layout_values: tuple[str, ...] | None = None, aliases: tuple[str, ...] = (),
        shown_default: str | None = None, **constraints: Any) -> Any:
    """A configuration key: a pydantic field with its default, its constraints (ge, gt, le, ...)
    and its declaration.

    meaning: one line, what `ultrascale config keys` and `ultrascale train --help` print.
    layout: the `Layout` field this key feeds (Config.layout(), the `memory` and `plan` flag of
        that name, a layout string `dp=8,tp=2,...`); None for keys that change neither memory nor
        time.
    layout_values: the values a layout may take where the estimator and the planner answer for
        more than the engine runs (master_dtype: the engine keeps fp32 masters, the estimator
        also sizes bf16 ones); None: the annotation's choices.
    aliases: other trainers' names for this key (Megatron, torchtitan, DeepSpeed, Hugging Face),
        so that a user who types theirs is pointed at ours.
    shown_default: what the key table says instead of the default (e.g. "from preset").
    """
    extra = {"layout": layout, "layout_values": list(layout_values) if layout_values else None,
             "aliases": list(aliases) or None, "shown_default": shown_default}
    extra = {k: v for k, v in extra.items() if v is not None}
    return Field(default, description=meaning, json_schema_extra=extra or None, **constraints)


@dataclass(frozen=True)
class Key:
    """One declared key, as its declaration says."""

    name: str  # dotted: section.key, or `device`
    field: FieldInfo

    def _extra(self, what: str):
        extra = self.field.json_schema_extra
        return extra.get(what) if isinstance(extra, dict) else None

    @property
    def meaning(self) -> str:
        return self.field.description or ""

    @property
    def layout(self) -> str | None:
        return self._extra("layout")

    @property
    def aliases(self) -> list[str]:
        return self._extra("aliases") or []

    @property
    def shown_default(self) -> str | None:
        return self._extra("shown_default")

    @property
    def section(self) -> str | None:
        return self.name.split(".")[0] if "." in self.name else None

    @property
    def attr(self) -> str:
        return self.name.split(".")[-1]

    @property
    def default(self) -> Any:
        return self.field.get_default(call_default_factory=True)

    @property
    def choices(self) -> tuple | None:
        """The values a Literal key takes (None for other types)."""
        ann = self.field.annotation
        if typing.get_origin(ann) in (typing.Union, types.UnionType):  # Optional[Literal[...]]
            ann = next(a for a in typing.get_args(ann) if a is not type(None))
        return typing.get_args(ann) if typing.get_origin(ann) is Literal else None

    @property
    def layout_values(self) -> tuple | None:
        """The values the key's layout field takes: those declared, else the choices but `auto`
        (a layout is always concrete)."""
        declared = self._extra("layout_values")
        if declared:
            return tuple(declared)
        return tuple(c for c in self.choices if c != "auto") if self.choices else None

    @property
    def value_type(self) -> type:
        """The scalar type of the key's values (int for Optional[int], str for a Literal)."""
        ann = self.field.annotation
        if typing.get_origin(ann) in (typing.Union, types.UnionType):
            ann = next(a for a in typing.get_args(ann) if a is not type(None))
        if typing.get_origin(ann) is Literal:
            return type(typing.get_args(ann)[0])
        return ann if isinstance(ann, type) else object


def _section_class(field: FieldInfo) -> type[BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def declared(root: type[BaseModel], prefix: str = "") -> list[Key]:
    """Every key of the tree under `root`, in declaration order (sections' keys dotted)."""
    out = []
    for name, field in root.model_fields.items():
        section = _section_class(field)
        out += declared(section, f"{prefix}{name}.") if section else [Key(prefix + name, field)]
    return out


def aliases(root: type[BaseModel]) -> dict[str, str]:
    """Other trainers' names -> our dotted keys."""
    return {alias: k.name for k in declared(root) for alias in k.aliases}


# -------------------------------------------------------------------------------------------------
# A mistyped key: the section matched first, then the key, then other trainers' names.


def suggest_key(root: type[BaseModel], loc: str) -> str | None:
    """The key meant by an unknown `loc`: the section first (closest section name), then the key
    within it (exact, another trainer's name for it, the closest spelling), then the same key in
    another section."""
    sections = {name: f.annotation for name, f in root.model_fields.items()}
    other = aliases(root)
    parts = loc.split(".")
    sec, rest = parts[0], parts[1:]
    if sec not in sections:
        if sec in other:
            return other[sec]
        close = difflib.get_close_matches(sec, list(sections), n=1, cutoff=0.6)
        if close:
            sec = close[0]
        elif not rest:  # a key given without its section, e.g. `lr`
            return _key_anywhere(root, sec)
        else:
            return _key_anywhere(root, rest[0])
    if not rest:
        return sec
    section = _section_class(root.model_fields[sec])
    if section is None:
        return sec  # `device` has no keys below it
    name, fields = rest[0], list(section.model_fields)
    if name in fields:
        return f"{sec}.{name}"
    if name in other:
        return other[name]
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if close:
        return f"{sec}.{close[0]}"
    return _key_anywhere(root, name)


def _key_anywhere(root: type[BaseModel], name: str) -> str | None:
    other = aliases(root)
    if name in other:
        return other[name]
    keys = [k.name for k in declared(root)]
    exact = [k for k in keys if k.split(".")[-1] == name]
    if exact:
        return exact[0]
    close = difflib.get_close_matches(name, [k.split(".")[-1] for k in keys], n=1, cutoff=0.75)
    return next((k for k in keys if close and k.split(".")[-1] == close[0]), None)


def explain(root: type[BaseModel], err: ValidationError) -> str:
    """A validation error as one readable paragraph per problem."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, ConfigError):
            lines.append(str(ctx_err))
        elif e["type"] == "extra_forbidden":
            # An unknown section comes as one error: name each key under it.
            sub = e.get("input")
            locs = [f"{loc}.{k}" for k in sub] if len(e["loc"]) == 1 and isinstance(sub, dict) \
                and sub else [loc]
            for full in locs:
                close = suggest_key(root, full)
                hint = f" Did you mean `{close}`?" if close and close != full else ""
                lines.append(f"Unknown configuration key `{full}`.{hint} Every key, with its "
                             "default and meaning: `ultrascale config keys`.")
        else:
            lines.append(f"`{loc}` = {e.get('input')!r} is invalid: {e['msg']}. "
                         "Fix the value in the YAML file or the --set override.")
    return "\n".join(lines)
