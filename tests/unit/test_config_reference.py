"""docs/config.md's key tables are generated from the schema; a stale page or a FlagScale note on a key the schema
does not have fails here."""

from flagscale.config.compat import FLAGSCALE_KEYS
from flagscale.config.reference import DOC, SECTIONS, render, with_generated


def test_docs_config_md_is_generated_from_the_schema():
    current = DOC.read_text()
    assert with_generated(current) == current, "docs/config.md is stale: python -m flagscale.config.reference --write"


def test_every_field_has_a_description_and_every_flagscale_note_a_field():
    paths = set()
    for _, model, prefix in SECTIONS:
        for name, info in model.model_fields.items():
            assert info.description, f"{prefix}{name} has no description"
            paths.add(prefix + name)
    assert set(FLAGSCALE_KEYS) - paths == set()
    assert "| `nnodes` | `null` | ignored (notice) |" in render()
