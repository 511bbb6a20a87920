"""batchtide: dashboards."""
