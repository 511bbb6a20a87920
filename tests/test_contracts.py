"""Generated artefacts stay equal to their sources: JSON Schemas, the configuration
reference in docs/configuration.md. And the exported schema agrees with the decoder."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import msgspec
import pytest

from pipeline.core.config_reference import END, START, marked_region, reference_markdown, write_into
from schemas.jsonschema import render
from schemas.messages import Request

ROOT = Path(__file__).resolve().parents[1]


def test_committed_json_schemas_are_up_to_date() -> None:
    rendered = render()
    assert rendered, "render() produced no schema: nothing would be checked"
    for path, text in rendered.items():
        assert path.exists(), f"{path.name} missing: run python -m schemas.jsonschema"
        assert path.read_text() == text, f"{path.name} is stale: run python -m schemas.jsonschema"


def test_configuration_reference_matches_the_code() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    start, end = marked_region(text)
    assert text[start:end] == reference_markdown(), (
        "docs/configuration.md is stale: batchtide config reference --write docs/configuration.md"
    )


def test_config_reference_write_replaces_only_the_marked_region(tmp_path: Path) -> None:
    doc = tmp_path / "configuration.md"
    doc.write_text(f"# intro\n\n{START}stale table\n{END}\n\nafter\n")
    assert write_into(str(doc)) is True
    assert doc.read_text() == f"# intro\n\n{START}{reference_markdown()}{END}\n\nafter\n"
    assert write_into(str(doc)) is False


REQUEST_SCHEMA = json.loads((ROOT / "schemas" / "request.schema.json").read_text())


@pytest.mark.parametrize(
    "payload",
    [
        {"id": "a", "model": "m", "text": "hi"},
        {"id": "a", "model": "m", "token_ids": [1, 2, 3], "priority": 0, "timeout_ms": 500},
        {"id": "a", "model": "m", "text": "hi", "priority": 12},
        {"id": "a", "model": "m", "text": 5},
        {"id": "", "model": "m", "text": "hi"},
        {"id": "a", "model": "m", "text": "hi", "surprise": True},
        {"id": "a", "model": "bad model!", "text": "hi"},
    ],
)
def test_exported_schema_and_decoder_agree(payload: dict) -> None:
    """A producer validating against the JSON Schema sees what the consumer sees
    (the one rule JSON Schema cannot say, exactly one of text/token_ids, aside)."""
    schema_ok = jsonschema.Draft202012Validator(REQUEST_SCHEMA).is_valid(payload)
    try:
        msgspec.json.decode(json.dumps(payload).encode(), type=Request)
        decoder_ok = True
    except msgspec.ValidationError:
        decoder_ok = False
    assert schema_ok == decoder_ok
