"""Reports from results only: aggregation, renderers and figures."""
