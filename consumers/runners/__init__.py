"""batchtide: consumers/runners."""
