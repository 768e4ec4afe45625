"""The modeling code an exported folder carries (``mhe export``, :mod:`mhe.hf.export`).

``configuration_mhe.py`` and ``modeling_mhe.py`` are copied as they are into every folder
``mhe export --format remote-code`` writes; ``config.json``'s ``auto_map`` points
transformers' Auto classes at them, so the folder loads with ``trust_remote_code=True`` in a
Python that has torch and transformers but not mhe. They import nothing from mhe (only torch
and transformers, and each other by relative import). This package exists so that they ship
inside mhe and so that mhe's tests can import them in process.
"""
