"""batchtide: pipeline/sim."""
