"""batchtide: pipeline/store."""
