"""A tensor-parallel degree the model cannot be split by is refused by the CLI before any rank
starts: exit code 2, the key, the value and the fix, and no traceback."""

import subprocess
import sys

import pytest


def _train(*overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "ultrascale.cli", "train"]
    for o in overrides:
        args += ["--set", o]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("overrides,expected", [
    (["parallel.tp=3"],
     ["parallel.tp=3 does not divide model.num_heads=4", "Choose tp among [1, 2, 4]"]),
    (["parallel.tp=4", "model.ffn_hidden_size=386"],
     ["parallel.tp=4 does not divide model.ffn_hidden_size=386", "Choose tp among [1, 2]"]),
])
def test_bad_tp_is_refused_before_launch(overrides, expected):
    result = _train(*overrides)
    assert result.returncode == 2
    for text in expected:
        assert text in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    # Refused while reading the config: nothing was printed about a run starting.
    assert "global batch" not in result.stdout
