"""Fixtures that start real services for the tests."""
