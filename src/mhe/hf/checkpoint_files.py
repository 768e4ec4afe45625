"""A Hugging Face model directory checked before ``from_pretrained`` reads it: its weights file
is there and whole, and every tensor has the shape its ``config.json`` gives, so a broken folder
is one line naming what is wrong (``MheError``) instead of a loader's traceback.

The safetensors layout (the format's specification): 8 bytes, the little-endian length N of a
JSON header; the header, N bytes, mapping each tensor's name to its ``dtype``, ``shape`` and
``data_offsets`` [begin, end) into the data that follows; the data, exactly as long as the
largest end offset.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from mhe.errors import MheError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the header of the safetensors file at ``path``, after checking
    that the header and the data it describes are all in the file (a truncated copy is refused)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise MheError(f"{path} is truncated: {size} bytes, not even the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise MheError(f"{path} is truncated: its header says {n:,} header bytes, the file has {size - 8:,} "
                           "after the length")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise MheError(f"{path} is not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise MheError(f"{path} is not a safetensors file: its header is not a JSON object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    if 8 + n + end != size:
        raise MheError(f"{path} is truncated or padded: its tensors end at byte {8 + n + end:,}, the file has "
                       f"{size:,} bytes")
    return {k: list(v["shape"]) for k, v in tensors.items()}


def weight_shapes(path: Path) -> dict[str, list[int]] | None:
    """Every tensor's shape in the directory's safetensors weights (one file or an index of shards),
    checked whole; None for a ``pytorch_model.bin`` (read by transformers as it is). A directory
    with no weights file is refused naming the files looked for."""
    if (path / "model.safetensors").is_file():
        return safetensors_shapes(path / "model.safetensors")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise MheError(f"{index} is not a safetensors index (a JSON object with a weight_map)") from None
        shapes = {}
        for shard in shards:
            if not (path / shard).is_file():
                raise MheError(f"{path} is missing {shard}, a shard {index.name} lists")
            shapes.update(safetensors_shapes(path / shard))
        return shapes
    if (path / "pytorch_model.bin").is_file():
        return None
    raise MheError(f"{path} has no weights: none of {', '.join(WEIGHT_FILES)}")


def check_shapes(path: Path, model_class, config) -> None:
    """Every tensor in the directory's weights has the shape ``model_class(config)`` gives it
    (built on the meta device: no memory); the first that differs is named with both shapes."""
    import torch

    shapes = weight_shapes(path)
    if shapes is None:
        return
    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in model_class(config).state_dict().items()}
    for name, shape in shapes.items():
        want = expected.get(name)
        if want is not None and want != shape:
            raise MheError(f"{path}: tensor {name} has shape {shape}, its config.json gives {want}; the weights "
                           "and config.json are of different models")
