"""Training: the classifier set-up, the instrumented loop, CUDA graphs, profilers, and one whole run."""
