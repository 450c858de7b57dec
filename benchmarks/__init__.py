"""Study scripts that run lora-bench configurations and print a short table (see README.md here)."""
