"""mhe: multi-head embedding attention and the attention variants it is compared with.

Xue & Aletras, "Pit One Against Many: Leveraging Attention-head Embeddings for
Parameter-efficient Multi-head Attention", Findings of EMNLP 2023.

The attention names are imported on first use (PEP 562), so that ``import mhe.cli`` (the ``mhe``
command's help and argument errors) does not import torch.
"""

from mhe.errors import MheError

__version__ = "0.1.0"
__all__ = ["KINDS", "PAPER_KINDS", "MheError", "build_attention", "__version__"]
_FROM_ATTENTION = ("KINDS", "PAPER_KINDS", "build_attention")


def __getattr__(name: str):
    if name in _FROM_ATTENTION:
        import mhe.attention

        return getattr(mhe.attention, name)
    raise AttributeError(f"module 'mhe' has no attribute {name!r}")
