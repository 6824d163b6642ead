"""`ultrascale config keys`: every configuration key with its default and what it means, and the
command-line flags of the layout keys (`ultrascale memory`, `ultrascale plan`).

All of it is read from the keys' declarations (`key(default, meaning, layout=...)` in
config_model.py and config_sections.py), so that the command line can answer without the docs;
docs/configuration.md says the same at more length (a test keeps both complete).
"""

from __future__ import annotations

import argparse

from ultrascale.config import Config, layout_keys
from ultrascale.config_fields import Key, declared
from ultrascale.layout import Layout

# dotted key -> its meaning, one line each.
MEANINGS = {k.name: k.meaning for k in declared(Config)}


def _default(k: Key) -> str:
    if k.shown_default is not None:  # e.g. what a preset (or a Hugging Face config) fills
        return k.shown_default
    value = k.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def rows(section: str | None = None) -> list[tuple[str, str, str]]:
    """(key, default, meaning) for every key, or those of one section."""
    return [(k.name, _default(k), k.meaning) for k in declared(Config)
            if not section or k.name.split(".")[0] == section]


def format_keys(section: str | None = None) -> str:
    table = rows(section)
    w_key = max(len(k) for k, _, _ in table)
    w_def = max(len(d) for _, d, _ in table)
    return "\n".join(f"{k:<{w_key}}  {d:<{w_def}}  {m}" for k, d, m in table)


# -------------------------------------------------------------------------------------------------
# The layout keys as flags, named as their Layout fields: --dp, --mbs, --grad-accum, --seq-len, ...


def layout_names() -> list[str]:
    """The Layout fields that keys feed, in declaration order (each a flag of that name)."""
    return [k.layout for k in layout_keys()]


def add_layout_flag(parser, name: str, default_note: str = "") -> None:
    """The flag `--name` of one layout field: its type, choices and help from the key's
    declaration. The flag's default is None, so that a flag given can override a config; the help
    shows Layout's default (what is used without a config), and `default_note` after it."""
    k = next(k for k in layout_keys() if k.layout == name)
    default = getattr(Layout(), name)
    shown = "none" if default is None else default
    help_text = f"{k.meaning} (default {shown}{default_note})"
    flag = "--" + name.replace("_", "-")
    if k.value_type is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
    elif k.layout_values:
        parser.add_argument(flag, choices=list(k.layout_values), help=help_text)
    else:
        parser.add_argument(flag, type=k.value_type, help=help_text)


def add_layout_flags(parser, default_note: str = "") -> None:
    """Every layout field as a flag (`ultrascale memory`'s layout group)."""
    for name in layout_names():
        add_layout_flag(parser, name, default_note)
