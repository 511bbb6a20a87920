"""JSON Schema files for the wire messages, for producers in other languages.

The schemas are generated from the msgspec types in `messages.py` (the one
source of truth) into `schemas/<name>.schema.json`; a test fails when the
committed files are stale. Regenerate with `python -m schemas.jsonschema`.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from schemas.messages import BatchEvent, DeadLetter, FleetBeacon, LagEvent, LatencyEvent, Request, Result

HERE = Path(__file__).parent
MESSAGES: dict[str, type] = {
    "request": Request,
    "result": Result,
    "latency_event": LatencyEvent,
    "batch_event": BatchEvent,
    "dead_letter": DeadLetter,
    "lag_event": LagEvent,
    "fleet_beacon": FleetBeacon,
}


def render() -> dict[Path, str]:
    files: dict[Path, str] = {}
    for name, message in MESSAGES.items():
        schema = msgspec.json.schema(message)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = f"batchtide {message.__name__}"
        files[HERE / f"{name}.schema.json"] = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    return files


def main() -> None:
    for path, text in render().items():
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
