"""The parts of ``uptrain.py``: the study and the methods study, their runs, stages and report."""
