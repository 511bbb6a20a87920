"""batchtide: tests."""
