"""Lower layers never import higher ones; the product never imports the development tools.

Read from the source with `ast` (every import, also those inside functions),
so a new upward arrow fails here before anyone has to untangle it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "consumers", "schemas", "dashboards")

LAYERS: dict[str, int] = {
    # 0: the ground: messages, typed config, the pure engine, the simulator
    "schemas": 0,
    "pipeline": 0,
    "pipeline.core.config": 0,
    "pipeline.core.config_reference": 0,
    "pipeline.core.engine": 0,
    "pipeline.core.sim": 0,
    # 1: plumbing: Kafka clients and topics, the ClickHouse store
    "pipeline.core.kafka": 1,
    "pipeline.core.store": 1,
    # 2: the product's processes
    "consumers": 2,
    "pipeline.sink": 2,
    # 3: what people look at, and the tools that stand in for the world around the processes
    "dashboards": 3,
    "pipeline.tools.views": 3,
    "pipeline.tools.devtools": 3,
    # 4: the end-to-end harness: the pipeline's processes run as a user runs them, and read back
    "pipeline.tools.harness": 4,
    # 5: what measures, breaks and demonstrates the rest
    "pipeline.tools.bench": 5,
    "pipeline.tools.chaos": 5,
    # 6: the command line
    "pipeline.tools.commands": 6,
    "pipeline.cli": 6,
}
"""Module prefix -> layer; the longest matching prefix wins."""

PROCESSES = 2
"""The layer of the product's processes (the consumers and the sink): every folder under pipeline/ lies on one side."""

APART = {
    ("pipeline.tools.devtools", "consumers"),
    ("pipeline.tools.devtools", "pipeline.sink"),
}
"""Pairs that must not import each other although the layers allow it: the dev tools stand in for the world
around the processes and so never lean on them (the processes, a layer below, cannot import the dev tools at all)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def placed(module: str) -> str | None:
    """The LAYERS prefix a module belongs to."""
    best = None
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def imports(path: Path, known: set[str]) -> set[str]:
    """Every first-party module `path` imports (`from a import b` counts as a.b when that is a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def sources() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def arrows() -> list[str]:
    """Every import that breaks the layering, as readable lines."""
    modules = sources()
    known = set(modules)
    broken: list[str] = []
    for module, path in sorted(modules.items()):
        here = placed(module)
        assert here is not None, f"{module} is in no layer: add its folder to LAYERS"
        for target in sorted(imports(path, known)):
            there = placed(target)
            assert there is not None, f"{module} imports {target}, which is in no layer"
            if LAYERS[there] > LAYERS[here]:
                broken.append(f"{module} (layer {LAYERS[here]}) imports {target} (layer {LAYERS[there]})")
            elif (here, there) in APART:
                broken.append(f"{module} imports {target}: {here} must not lean on {there}")
    return broken


def test_no_import_points_upward() -> None:
    assert arrows() == []


def test_the_core_folder_holds_only_what_consumers_stand_on() -> None:
    """`pipeline/core/` is the folder line of the layering: its modules import nothing above it."""
    known = set(sources())
    core = {name: path for name, path in sources().items() if name.startswith("pipeline.core")}
    assert len(core) > 40
    outside = {
        f"{name} imports {target}"
        for name, path in core.items()
        for target in imports(path, known)
        if not target.startswith(("pipeline.core", "schemas"))
    }
    assert outside == set()


def test_the_check_sees_an_upward_arrow(tmp_path: Path) -> None:
    """The checker itself catches what it is for: an engine module importing the consumer."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from consumers.worker import Consumer\n    from pipeline.core import config\n")
    found = imports(probe, {"consumers.worker", "pipeline.core.config"})
    assert found == {"consumers.worker", "pipeline.core.config"}
    assert LAYERS[placed("consumers.worker")] > LAYERS[placed("pipeline.core.engine.engine")]  # type: ignore[index]
    assert (
        placed("pipeline.sink.app") == "pipeline.sink" and placed("pipeline.core.store.writer") == "pipeline.core.store"
    )


def test_each_folder_under_pipeline_lies_on_one_side_of_the_processes() -> None:
    """A folder under pipeline/ is wholly below the processes (core), wholly the process layer (sink) or wholly
    above it (tools), so the tree itself shows the layering."""
    sides: dict[str, set[str]] = {}
    for module in sources():
        parts = module.split(".")
        if parts[0] == "pipeline" and len(parts) > 2:
            layer = LAYERS[placed(module)]  # type: ignore[index]
            side = "below" if layer < PROCESSES else "process" if layer == PROCESSES else "above"
            sides.setdefault(parts[1], set()).add(side)
    assert {folder: sorted(found) for folder, found in sides.items()} == {
        "core": ["below"],
        "sink": ["process"],
        "tools": ["above"],
    }
