"""Multi-token prediction (models/mtp.py) on packed documents and under a loss mask: each depth's
targets and input tokens (`future_targets`) against their definition written out position by
position, and a packed batch of tiny-deepseek (two MTP depths) giving the main and MTP losses and
every gradient of its documents run one by one, with and without recomputation (which also holds
multi-head latent attention to the documents: its core had been called without them, 3e-4 of
the loss off).

Tolerances as tests/test_document_mask.py's, the model in fp64: a packed document's attention rows
differ from its own by masked keys only (zero probability), and the rest sums the same terms in
another order; the cross-entropy sums its tokens in fp32 (ops.cross_entropy), so the losses and
the gradients carry fp32's reassociation, within log2(72) x eps32 = 4e-7 of their scale: 1e-6,
far below the fault injected below (each depth's input tokens read from the targets, as before
chat data was taken: a loss-masked token embedded as token 0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parity import make_config
from ultrascale.data.windows import IGNORE, Window, micro_batch
from ultrascale.models import mtp as mtp_module
from ultrascale.models.documents import Documents
from ultrascale.models.llama import build_model
from ultrascale.parallel.recompute import apply_recompute

SEQ, DEPTH = 24, 2
LAYOUTS = [[5, 11, 8], [24], [2, 1, 21]]  # each sequence's document lengths


def _windows(generator: torch.Generator, masked: bool) -> list[Window]:
    """Packed windows of SEQ + 1 tokens; `masked`: every third target position counts nothing
    (a chat loss mask: the user's tokens)."""
    windows = []
    for lengths in LAYOUTS:
        tokens = torch.randint(0, 256, (SEQ + 1,), generator=generator).numpy()
        counted = np.ones(SEQ + 1, dtype=bool)
        if masked:
            counted[::3] = False
        windows.append(Window(tokens, np.cumsum(lengths)[:-1].astype(np.int64), counted))
    return windows


def _defined(window: Window, k: int) -> tuple[list[int], list[int]]:
    """Depth k's targets and inputs by definition: at position i the target is token i + k + 1
    where it exists, counts, and lies in position i's document; the input is token i + k."""
    w, edges = window.tokens, [0, *window.begins.tolist(), SEQ + 1]
    doc = np.searchsorted(edges, np.arange(SEQ + 1), side="right")
    targets, inputs = [], []
    for i in range(SEQ):
        j = i + k + 1
        ok = j <= SEQ and window.counted[j] and doc[j] == doc[i]
        targets.append(int(w[j]) if ok else IGNORE)
        inputs.append(int(w[i + k]) if i + k < SEQ else 0)
    return targets, inputs


@pytest.mark.parametrize("masked", [False, True])
def test_each_depths_targets_and_inputs_are_as_defined(masked):
    windows = _windows(torch.Generator().manual_seed(1), masked)
    inputs, targets, starts = micro_batch(windows)
    future = mtp_module.future_targets(torch.from_numpy(inputs), torch.from_numpy(targets), DEPTH,
                                       torch.from_numpy(starts))
    assert future.shape == (2 * DEPTH, len(windows), SEQ)
    for row, window in enumerate(windows):
        for k in range(1, DEPTH + 1):
            want_targets, want_inputs = _defined(window, k)
            assert future[k - 1, row].tolist() == want_targets, (row, k)
            assert future[DEPTH + k - 1, row].tolist() == want_inputs, (row, k)


def _model(recompute: str = "none"):
    # The sequence-wise balance loss is the packed sequence's, not each document's: left out
    # (the bias-only balance has no gradient).
    cfg = make_config(["model.preset=tiny-deepseek", f"model.mtp_layers={DEPTH}",
                       "model.balance=aux_free"])
    model = apply_recompute(build_model(cfg.model, 5).double(), recompute)
    model.mtp.loss_scale = 1.0
    return model


def _run(model, tokens, targets, documents=None) -> tuple[torch.Tensor, list[float]]:
    """(main summed loss, MTP summed loss per depth) of one forward and backward."""
    model.mtp.reset()
    starts = documents.starts if documents is not None else None
    future = mtp_module.future_targets(tokens, targets, DEPTH, starts)
    loss = model(tokens, None, targets, documents, future)
    loss.backward()
    return loss.detach(), [float(s) for s in model.mtp.loss_sums]


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _packed_and_alone(model, windows):
    inputs, targets, starts = micro_batch(windows)
    packed = _run(model, torch.from_numpy(inputs), torch.from_numpy(targets),
                  Documents.of(starts))
    packed_grads = _grads(model)
    main, per_depth = torch.zeros((), dtype=torch.float64), [0.0] * DEPTH
    for window in windows:  # each document alone, from position 0, with its own targets
        edges = [0, *window.begins.tolist(), SEQ]
        _, row_targets, _ = micro_batch([window])
        for a, b in zip(edges, edges[1:]):
            doc_tokens = torch.from_numpy(window.tokens[a:b].astype(np.int64))[None]
            doc_targets = torch.from_numpy(row_targets[:, a:b])
            loss, depths = _run(model, doc_tokens, doc_targets)
            main = main + loss
            per_depth = [x + y for x, y in zip(per_depth, depths)]
    alone_grads = {n: g for n, g in _grads(model).items()}
    return packed, (main, per_depth), packed_grads, alone_grads


@pytest.mark.parametrize("masked,recompute", [(False, "none"), (True, "none"),
                                              (True, "norms_and_mla_up"), (True, "full")])
def test_packed_documents_give_their_mtp_losses_and_gradients_one_by_one(masked, recompute):
    model = _model(recompute)
    windows = _windows(torch.Generator().manual_seed(0), masked)
    (main, depths), (main_alone, depths_alone), got, want = _packed_and_alone(model, windows)
    assert all(d > 0 for d in depths)
    torch.testing.assert_close(main.double(), main_alone.double(), rtol=1e-6, atol=0.0)
    assert depths == pytest.approx(depths_alone, rel=1e-6)
    for name, g in want.items():  # the MTP layers' and the shared embedding's and head's too
        torch.testing.assert_close(got[name], g, rtol=0.0, atol=1e-6 * float(g.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_the_tolerance_sees_depth_inputs_read_from_masked_targets(monkeypatch):
    """The fault: each depth's input tokens taken from the targets (a loss-masked token is
    embedded as token 0, as before chat data was taken), under the mask."""
    real = mtp_module.future_targets

    def from_targets(tokens, targets, depth, starts=None):
        future = real(tokens, targets, depth, starts)
        rows = [targets.masked_fill(targets == IGNORE, 0)] + \
            [future[k].masked_fill(future[k] == IGNORE, 0) for k in range(depth - 1)]
        return torch.cat([future[:depth], torch.stack(rows)])

    monkeypatch.setattr(mtp_module, "future_targets", from_targets)
    model = _model()
    windows = _windows(torch.Generator().manual_seed(0), masked=True)
    (_, depths), _, _, _ = _packed_and_alone(model, windows)
    monkeypatch.setattr(mtp_module, "future_targets", real)
    (_, good), _, _, _ = _packed_and_alone(_model(), windows)
    assert all(abs(d - g) > 1e-3 * g for d, g in zip(depths, good))
