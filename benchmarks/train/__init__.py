"""The parts of ``train_bench.py``: one module per subcommand, and the runs they share (``runs.py``)."""
