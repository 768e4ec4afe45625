"""The commands of ``benchmarks/decode.py``, one module each, and the pieces they share
(``rows``: ``model.generate``'s timings and kernel counts; ``speed_report``: ``speed``'s markdown;
``floor``: the decode step, its bytes and the prefill's FLOPs). Importing this package imports
nothing of ``mhe``: ``rows`` and ``beam`` run against an older tree on ``PYTHONPATH``."""
