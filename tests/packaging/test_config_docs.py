"""docs/configuration.md is generated from the config models and never drifts from them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from refpipe.cli.config_docs import render, section

PAGE = Path(__file__).parents[2] / "docs" / "configuration.md"


def test_the_committed_page_is_what_the_generator_prints():
    printed = subprocess.run([sys.executable, "-m", "refpipe.cli.config_docs"], capture_output=True, text=True,
                             check=True).stdout
    assert printed == render()
    assert PAGE.read_text() == printed, "regenerate: python -m refpipe.cli.config_docs > docs/configuration.md"


def test_every_section_and_key_of_the_run_config_has_a_row_with_its_meaning():
    from refpipe.job.config import RunConfig

    text = render()
    for name, field in RunConfig.model_fields.items():
        assert f"## `[{name}]`" in text
        for key, info in field.annotation.model_fields.items():
            assert info.description, f"{name}.{key} has no docstring"
            assert f"\n| `{key}` | " in text


def test_a_row_gives_type_bounds_run_default_and_the_docstring_as_one_cell():
    from pydantic import Field

    class Probe(BaseModel):
        """A probe section."""

        model_config = {"use_attribute_docstrings": True}

        width: int = Field(default=4, ge=1, le=8)
        """Width in ``tokens``,
        at most 8 | never 0."""
        name: str | None = None
        """Unset by default."""

    assert section("probe", Probe, Probe(width=2)).splitlines() == [
        "## `[probe]`", "", f"A probe section. (`{Probe.__module__}.Probe`)", "",
        "| key | type | default | meaning |", "|---|---|---|---|",
        "| `width` | `int, >= 1, <= 8` | `2` (component: `4`) | Width in `tokens`, at most 8 \\| never 0. |",
        "| `name` | `str \\| None` | unset | Unset by default. |",
    ]
