"""batchtide: schemas."""
