"""The verdict threshold, apart from the statistics so that the command line reads it without
importing NumPy: a ratio must clear 1 ± 2 % with its whole 95 % interval to count as a difference."""

THRESHOLD = 0.02
