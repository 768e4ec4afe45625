"""The training engine: typed run configuration, the trainer and its state, checkpoints and run files."""
