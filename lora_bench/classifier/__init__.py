"""The classifier a run trains: GPT-2 with the reference's new head and trainable layers."""
