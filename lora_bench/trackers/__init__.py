"""Trackers: a results folder's runs written to MLflow and TensorBoard (``lora-bench results
export``, and one run right after it is saved), from the run records alone. The trackers are an
optional extra (``lora-bench[trackers]``), imported only when an export runs."""
