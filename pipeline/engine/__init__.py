"""batchtide: pipeline/engine."""
