"""One name per idea in the product: no class name defined twice, no file name used twice (`__init__.py` aside).

A search for a class or a file then lands on the one place that holds it. Read with `ast` from
the source, so a second `Device` or a fifth `fleet.py` fails here when it is written.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "consumers", "schemas", "dashboards")


def product_files(root: Path = ROOT) -> list[Path]:
    return sorted(p for package in PACKAGES for p in (root / package).rglob("*.py"))


def repeated_classes(files: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """Class name -> where it is defined, for each name defined more than once (nested classes too)."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path.relative_to(root)}:{node.lineno}")
    return {name: places for name, places in where.items() if len(places) > 1}


def repeated_file_names(files: list[Path], root: Path = ROOT) -> dict[str, list[str]]:
    """File name -> its paths, for each name (other than `__init__.py`) that more than one file bears."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in files:
        if path.name != "__init__.py":
            where[path.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in where.items() if len(paths) > 1}


def test_no_class_name_is_defined_twice() -> None:
    assert repeated_classes(product_files()) == {}


def test_no_product_file_name_is_used_twice() -> None:
    assert repeated_file_names(product_files()) == {}


def test_the_checks_see_a_repeat(tmp_path: Path) -> None:
    """The checkers catch what they are for: the same class name and file name in two folders."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "fleet.py").write_text("class Fleet:\n    pass\n")
        (tmp_path / folder / "__init__.py").write_text("")
    files = sorted(tmp_path.rglob("*.py"))
    assert repeated_classes(files, tmp_path) == {"Fleet": ["a/fleet.py:1", "b/fleet.py:1"]}
    assert repeated_file_names(files, tmp_path) == {"fleet.py": ["a/fleet.py", "b/fleet.py"]}
