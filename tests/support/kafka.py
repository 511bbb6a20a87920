"""Fixtures: kafka (filled in by its issue)."""
