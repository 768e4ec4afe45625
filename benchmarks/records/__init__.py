"""The parts of ``results_tools.py``: the run-folder migration and the scaling overview."""
