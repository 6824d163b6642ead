"""Muon's momentum in checkpoints: saved piece by piece like Adam's moments (the layout-free
format stores each held value's optimizer state), so a run resumed from step 3 continues exactly:
in the same layout (ZeRO-1 shards of the momentum, losses and weights bitwise), and in another
(written by dp2 ZeRO-1, read by one process: losses within 1e-5, weights within 1e-5)."""

import json

import pytest
import torch

from parity import assert_resumes_exactly, run_layout

MUON = ["training.optimizer=muon", "training.steps=6", "parallel.bucket_mb=0.05"]


@pytest.mark.slow
def test_muon_resumes_exactly(tmp_path):
    full = assert_resumes_exactly(MUON + ["parallel.dp=2", "parallel.zero=1"], tmp_path)
    tensors = json.loads((tmp_path / "step_00000003" / "meta.json").read_text())["tensors"]
    assert "momentum_buffer" in tensors["layers.0.attn.q_proj.weight"]["states"]
    assert "exp_avg" in tensors["embed.weight"]["states"]  # AdamW's
    # Another layout reads the same checkpoint: one process, the same 4 sequences a step.
    other = run_layout(MUON + ["training.grad_accum_steps=2", f"checkpoint.dir={tmp_path / 'b'}",
                               f"checkpoint.resume={tmp_path / 'step_00000003'}"])[0]
    torch.testing.assert_close(torch.tensor(other["losses"], dtype=torch.float64),
                               torch.tensor(full[0]["losses"][3:], dtype=torch.float64),
                               rtol=1e-5, atol=0.0)
    for name, t in full[0]["state"].items():
        torch.testing.assert_close(other["state"][name], t, rtol=1e-5, atol=1e-5)
