"""Fixtures: models (filled in by its issue)."""
