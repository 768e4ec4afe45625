"""mhe: multi-head embedding attention and the attention variants it is compared with.

Xue & Aletras, "Pit One Against Many: Leveraging Attention-head Embeddings for
Parameter-efficient Multi-head Attention", Findings of EMNLP 2023.
"""

from mhe.attention import KINDS, PAPER_KINDS, build_attention
from mhe.errors import MheError

__version__ = "0.1.0"
__all__ = ["KINDS", "PAPER_KINDS", "MheError", "build_attention", "__version__"]
