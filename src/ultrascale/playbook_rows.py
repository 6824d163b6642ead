"""The model of each row of a nanotron scaling-benchmark table (the playbook's `bench_*.csv`):
one rule for the memory estimator's and the planner's comparisons against published runs.

The table names a model (`1.34G`, `80G`, ...) and gives its hidden size, layers, heads and
vocabulary, but not its MLP width, and its failed rows leave the key/value heads and the tied
embeddings blank. So the shape is read once per model over all the rows:
- key/value heads: the column, or the name's `_gqa<N>` suffix (failed rows), else the heads;
- tied embeddings: what the model's successful rows say;
- the MLP width: the multiple of 256 whose parameter count is closest to the most precise count
  the table has, a successful single-stage row's `Total Params` (three digits: "70.6G"), else
  a pipeline row's (which counts a tied embedding twice). A model without a successful row
  takes a sibling's width and tie (`row_models`), and failing that `num_params`, tied.
A model's label is the name's first field, with the `_vocab<N>` and `_gqa<N>` fields that set it
apart from another model of that name (`80G`, `80G_gqa8`, `80G_vocab49k`).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from ultrascale.config import ModelConfig

_GQA = re.compile(r"_gqa(\d+)")
_VOCAB = re.compile(r"_(vocab\w+?)(?:_|$)")


def parse_count(text: str) -> float | None:
    """'1.61G' -> 1.61e9; '' -> None."""
    text = (text or "").strip()
    if not text:
        return None
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}[text[-1]]
    return float(text[:-1]) * scale


def row_kv_heads(row: dict) -> int:
    if row.get("num_kv_heads"):
        return int(float(row["num_kv_heads"]))
    gqa = _GQA.search(row["name"])
    return int(gqa.group(1)) if gqa else int(row["num_heads"])


def shape_key(row: dict) -> tuple:
    return (int(row["hidden_size"]), int(row["num_layers"]), int(row["num_heads"]),
            row_kv_heads(row), int(row["vocab_size"]))


def solve_ffn(h: int, layers: int, heads: int, kv: int, vocab: int, tied: bool,
              billions: float) -> int:
    """The MLP width (a multiple of 256) whose parameter count is closest to `billions`."""
    best = None
    for f in range(256, 16 * h + 1, 256):
        m = ModelConfig(preset=None, hidden_size=h, num_layers=layers, num_heads=heads,
                        num_kv_heads=kv, ffn_hidden_size=f, vocab_size=vocab, tie_embeddings=tied)
        err = abs(m.num_params() / 1e9 - billions)
        if best is None or err < best[0]:
            best = (err, f)
    return best[1]


def _count_billions(rows: list[dict], tied: bool, h: int, vocab: int) -> float:
    """The most precise parameter count of a model's rows, in billions (see the module's
    docstring)."""
    ok = [r for r in rows if r["status"] == "Success" and parse_count(r.get("Total Params"))]
    single = [r for r in ok if int(r["pp"]) == 1]
    if single:
        return Counter(parse_count(r["Total Params"]) for r in single).most_common(1)[0][0] / 1e9
    if ok:
        counted = Counter(parse_count(r["Total Params"]) for r in ok).most_common(1)[0][0]
        return (counted - (vocab * h if tied else 0)) / 1e9
    return float(rows[0]["num_params"])


def _label(rows: list[dict]) -> str:
    name = rows[0]["name"]
    extra = [m.group(1) for m in [_VOCAB.search(name)] if m] + [
        f"gqa{m.group(1)}" for m in [_GQA.search(name)] if m]
    return "_".join([name.split("_")[0], *extra])


def row_models(rows: list[dict]) -> dict[tuple, tuple[str, ModelConfig]]:
    """shape_key -> (label, model) for every model the rows name. A model none of whose runs
    succeeded takes the MLP width and embedding tie of a sibling (same hidden size, layers and
    heads) that has some: the benchmark varied vocabulary and key/value heads around one model."""
    by_shape: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        by_shape[shape_key(row)].append(row)
    solved: dict[tuple, tuple[int, bool]] = {}
    for key, group in by_shape.items():
        said = {r["tie_word_embeddings"] for r in group if r["status"] == "Success"
                and r.get("tie_word_embeddings")}
        if said:
            h, layers, heads, kv, vocab = key
            tied = "False" not in said
            solved[key] = (solve_ffn(h, layers, heads, kv, vocab, tied,
                                     _count_billions(group, tied, h, vocab)), tied)
    first_names = Counter(group[0]["name"].split("_")[0] for group in by_shape.values())
    out = {}
    for key, group in by_shape.items():
        h, layers, heads, kv, vocab = key
        sibling = next((v for k, v in solved.items() if k[:3] == key[:3]), None)
        f, tied = solved.get(key) or sibling or (solve_ffn(
            h, layers, heads, kv, vocab, True, float(group[0]["num_params"])), True)
        model = ModelConfig(preset=None, hidden_size=h, num_layers=layers, num_heads=heads,
                            num_kv_heads=kv, ffn_hidden_size=f, vocab_size=vocab,
                            tie_embeddings=tied)
        name = group[0]["name"].split("_")[0]
        out[key] = (_label(group) if first_names[name] > 1 else name, model)
    return out
