"""The configuration reference names every key the config accepts."""

from pathlib import Path

from pydantic import BaseModel

from ultrascale.config import Config

DOC = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()


def test_every_config_key_is_documented():
    for section, field in Config.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            assert f"## {section}" in DOC
            for key in ann.model_fields:
                assert f"`{key}`" in DOC, f"{section}.{key} is not in docs/configuration.md"
        else:
            assert f"## {section}" in DOC


def test_the_planner_guide_is_a_guide_and_the_lab_notes_are_kept():
    root = Path(__file__).parent.parent
    guide = (root / "docs" / "planner.md").read_text()
    notes = (root / "benchmarks" / "planner_notes.md").read_text()
    assert len(guide.splitlines()) <= 250
    assert "benchmarks/planner_notes.md" in guide
    for section in ("## The cost model", "## Against the playbook's H100 runs",
                    "## On a CPU machine: calibrate and sweep"):
        assert section in notes


def test_the_guides_commands_parse():
    import re
    import shlex

    from ultrascale.cli import build_parser

    root = Path(__file__).parent.parent
    for doc in ("planner.md", "configuration.md", "memory.md", "moe.md", "hf.md",
                "context_parallel.md", "muon.md", "sft.md", "pipeline.md", "deepseek.md"):
        text = (root / "docs" / doc).read_text()
        for block in re.findall(r"```\w*\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.removeprefix("$ ")
                if line.startswith("ultrascale ") and "GRID.yaml" not in line:
                    build_parser().parse_args(shlex.split(line, comments=True)[1:])
