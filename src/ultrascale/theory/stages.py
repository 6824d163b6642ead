"""Which layers each pipeline rank holds (parallel/pipeline/): the split of the layers into the
pp x v stages (the config's `parallel.pp_layers`, the engine's, or nanotron's by cost), and the
layers and parameters of a rank under it. `pipeline.py` costs the busiest rank; it and the
memory estimator read these. Torch-free.
"""

from __future__ import annotations

from functools import lru_cache

from ultrascale.layout import Layout
from ultrascale.params import dense_layers_in, even_split_params
from ultrascale.parallel.pipeline.schedules import placement_of, stage_of
from ultrascale.rules import layers_per_stage


def rank_layers(model, lay: Layout, pp_layers=None) -> list[int]:
    """Layers on each pipeline rank: the sum of its virtual stages' shares (under dualpipev's V,
    stages r and 2pp - 1 - r), the stages split as `stage_split` says."""
    return list(split_rank_layers(stage_split(model, lay, pp_layers), lay.pp, lay.pp_schedule))


def stage_split(model, lay: Layout, pp_layers=None) -> tuple[int, ...]:
    """Layers of each of the pp x v stages: `pp_layers` (the config's `parallel.pp_layers`) as
    given, else as the engine splits them (`rules.layers_per_stage`: the last stages take the
    extra layers)."""
    stages = lay.pp * lay.pp_virtual_stages
    if pp_layers is None:
        return engine_split(model.num_layers, stages)
    split = tuple(int(n) for n in pp_layers)
    if len(split) != stages or sum(split) != model.num_layers or min(split) < 1:
        raise ValueError(f"pp_layers={list(split)} must list pp x pp_virtual_stages = {stages} "
                         f"positive layer counts summing to the model's {model.num_layers} "
                         "layers.")
    return split


def rank_dense_layers(model, lay: Layout, pp_layers=None) -> tuple[int, ...] | None:
    """Dense-MLP layers (a mixture of experts' first `first_k_dense`) on each pipeline rank where
    its chunks lie apart (interleaved, dualpipev): the stages (`stage_split`) hold the layers in
    order, each on the rank its schedule places it (under dualpipev's V rank 0 holds the first
    stage and the last). None where one run of layers per rank is exact, or `pp_layers` gives
    the ranks' layers, not the stages'."""
    stages = lay.pp * lay.pp_virtual_stages
    if stages == lay.pp or not model.num_experts or not getattr(model, "first_k_dense", 0) \
            or (pp_layers and len(pp_layers) != stages):
        return None
    split = stage_split(model, lay, pp_layers)
    placement, v = placement_of(lay.pp_schedule), lay.pp_virtual_stages
    firsts = [sum(split[:s]) for s in range(len(split))]
    return tuple(sum(dense_layers_in(model, firsts[s], split[s])
                     for s in (stage_of(rank, c, lay.pp, placement) for c in range(v)))
                 for rank in range(lay.pp))


@lru_cache(maxsize=4096)
def engine_split(num_layers: int, stages: int) -> tuple[int, ...]:
    return tuple(layers_per_stage(num_layers, stages))


@lru_cache(maxsize=4096)
def split_rank_layers(split: tuple[int, ...], pp: int, schedule: str) -> tuple[int, ...]:
    """Layers on each pipeline rank of the stages `split`, placed as `schedule` places them."""
    placement, v = placement_of(schedule), len(split) // pp
    return tuple(sum(split[stage_of(rank, c, pp, placement)] for c in range(v))
                 for rank in range(pp))


def cost_balanced_ranks(model, pp: int, strict: bool = True) -> list[tuple[int, bool]]:
    """(layers, holds the output head) of each pipeline rank, as nanotron splits a model: its
    blocks (the layers at 4 h^2 + 3 f h each, then the head at vocab x h) go to ranks in order, and
    a rank takes blocks until their summed cost passes its share of the total (the block that
    passes it included). A large head thus gets a rank with few layers or none, and the ranks
    after it hold nothing: 1.34B (the head = 4 layers) on pp 8 puts 3, 3, 2, 3, 2, 3 layers on
    ranks 0-5, the head alone on rank 6, and nothing on rank 7. `strict`: "passes" is > (nanotron's
    current test); False for >=, the version some of the playbook's runs used (they differ only
    on exact ties)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    costs = [4 * h * h + 3 * f * h] * model.num_layers + [model.vocab_size * h]
    total = sum(costs)
    layers, head = [0] * pp, [False] * pp
    rank, cumulative = 0, 0
    for i, cost in enumerate(costs):
        cumulative += cost
        if i < model.num_layers:
            layers[rank] += 1
        else:
            head[rank] = True
        share = total * (rank + 1) / pp
        if (cumulative > share if strict else cumulative >= share) and rank < pp - 1:
            rank += 1
    return list(zip(layers, head))


def busiest_stage_layers(model, lay: Layout, pp_layers=None) -> int:
    """Layers on the most loaded pipeline rank (all of its virtual stages)."""
    return max(rank_layers(model, lay, pp_layers))


def busiest_params(model, lay: Layout, layers: int | None = None) -> float:
    """Parameters held by one rank of the busiest stage (the one with the output head), the
    matmul weights split evenly (`params.even_split_params`): the first and last stage each hold
    a vocabulary matrix; a single stage holds two unless tied. `layers`: its layers when known
    (`busiest_stage_layers`)."""
    vocab_matrices = 2 if lay.pp == 1 and not model.tie_embeddings else 1
    if layers is None:
        layers = busiest_stage_layers(model, lay)
    return even_split_params(model, lay, layers, vocab_matrices)
