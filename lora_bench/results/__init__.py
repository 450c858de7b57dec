"""Results: the schema of the result tables, their store, the recorded environment and the metrics."""
