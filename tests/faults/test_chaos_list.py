"""`batchtide chaos --list`: a name and a real one-line description per fault (no broker needed)."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from pipeline.tools.chaos.catalogue import SCENARIOS, FaultScenario
from pipeline.tools.commands import chaos

app = typer.Typer()
chaos.register(app)


def test_every_fault_is_listed_with_a_sentence_of_its_own() -> None:
    result = CliRunner().invoke(app, ["--list"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == list(SCENARIOS)
    for line, scenario in zip(lines, SCENARIOS.values(), strict=True):
        description = line.split(maxsplit=1)[1].removesuffix("(3-broker cluster)").strip()
        assert len(description.split()) >= 3, line
        assert "partial(" not in description and "<function" not in description, line
        assert description.count("(") == description.count(")"), f"cut inside parentheses: {line}"
        assert line.endswith("(3-broker cluster)") == scenario.cluster, line


def test_a_summary_stops_at_the_first_clause_outside_parentheses() -> None:
    async def fault(stage: object, sizes: object) -> None:
        """Freeze the leader (it is fenced: a follower after). Then more.

        Details."""

    assert FaultScenario("x", fault).summary == "Freeze the leader (it is fenced: a follower after)"  # type: ignore[arg-type]
