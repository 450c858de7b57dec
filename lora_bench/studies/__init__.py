"""Device studies: scripts that run several configurations in one call and print a short table."""
