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
