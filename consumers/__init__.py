"""batchtide: consumers."""
