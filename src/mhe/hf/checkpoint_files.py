"""A Hugging Face model directory checked before ``from_pretrained`` reads it: its weights file
is there and whole, every tensor has the shape its ``config.json`` gives, every parameter of the
model ``config.json`` describes is stored (a tied copy aside) and every stored tensor is one of
them (buffers the model recomputes and a masked-LM checkpoint's pre-training-only parts aside,
:data:`SKIPPED`), so a broken folder, or weights of another depth than its ``config.json``, is one
line naming what is wrong (``MheError``) instead of a loader's traceback or a silently random or
dropped layer. Only safetensors is read: a pickle (``pytorch_model.bin``) is refused unopened.

The safetensors layout (the format's specification): 8 bytes, the little-endian length N of a
JSON header; the header, N bytes, mapping each tensor's name to its ``dtype``, ``shape`` and
``data_offsets`` [begin, end) into the data that follows; the data, exactly as long as the
largest end offset.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from mhe.errors import MheError, name_keys

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
SKIPPED = {
    ".attn.bias": "GPT-2's causal mask buffer (older transformers saved it; rebuilt from the length)",
    ".attn.masked_bias": "GPT-2's masking constant buffer (older transformers saved it)",
    ".rotary_emb.inv_freq": "rotary frequencies, recomputed from config.json's rope settings",
    "embeddings.position_ids": "BERT's position index buffer (0, 1, 2, ...)",
}
"""Stored tensor name endings that no parameter takes, deliberately: buffers recomputed from
``config.json``. A masked-LM model also skips :data:`PRETRAINING_ONLY`."""
PRETRAINING_ONLY = ("bert.pooler.", "cls.seq_relationship.")
"""A ``BertForMaskedLM`` folder's pooler and next-sentence head (``bert-base-*`` ship them): parts
of BERT's pre-training that a masked-LM model does not have."""


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


def weight_shapes(path: Path) -> dict[str, list[int]]:
    """Every tensor's shape in the directory's safetensors weights (one file or an index of shards),
    checked whole. A directory with no safetensors weights is refused naming the files looked for
    (a pickle among them: refused unopened, naming how to re-save it)."""
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
    pickled = [name for name in PICKLES if (path / name).is_file()]
    if pickled:
        raise MheError(f"{path} holds its weights only as {pickled[0]} (a pickle, not opened: loading one can run "
                       "code); mhe reads safetensors: re-save it with save_pretrained(dir, safe_serialization=True)")
    raise MheError(f"{path} has no weights: none of {', '.join(WEIGHT_FILES)}")


def check_shapes(path: Path, model_class, config) -> None:
    """The directory's weights are exactly those of ``model_class(config)`` (built on the meta
    device: no memory): every tensor has the shape it gives (the first that differs is named with
    both shapes), every parameter is stored (tied copies aside) and every stored tensor is one of
    them (:data:`SKIPPED` aside); otherwise one line naming up to five keys and the count of the rest."""
    import torch

    shapes = weight_shapes(path)
    with torch.device("meta"):
        model = model_class(config)
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    for name, shape in shapes.items():
        want = expected.get(name)
        if want is not None and want != shape:
            raise MheError(f"{path}: tensor {name} has shape {shape}, its config.json gives {want}; the weights "
                           "and config.json are of different models")
    tied = _tied_copies(model, shapes)
    missing = [k for k in expected if k not in shapes and k not in tied]
    extra = PRETRAINING_ONLY if model_class.__name__ == "BertForMaskedLM" else ()
    unused = [k for k in shapes if k not in expected and not k.endswith(tuple(SKIPPED)) and not k.startswith(extra)]
    if missing:
        raise MheError(f"{path}: config.json's model has weights the folder does not store ({name_keys(missing)}); "
                       "the weights and config.json are of different models (no weight is left at random)")
    if unused:
        raise MheError(f"{path}: the folder stores weights config.json's model does not have ({name_keys(unused)}); "
                       "the weights and config.json are of different models (no stored weight is dropped)")


def _tied_copies(model, shapes: dict) -> set[str]:
    """Parameter names of ``model`` that are the same tensor as a stored one (tied copies)."""
    stored = {id(p) for k, p in model.named_parameters(remove_duplicate=False) if k in shapes}
    return {k for k, p in model.named_parameters(remove_duplicate=False) if id(p) in stored}
