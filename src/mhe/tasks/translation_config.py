"""Translation's settings: its ``data.task_options`` and its default schedule (paper Table 3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mhe.settings import setting
from mhe.training.config import TrainConfig
from mhe.training.task import is_tiny


@dataclass(frozen=True)
class TranslationOptions:
    """Translation (paper Table 3): languages, ``max_tokens`` per batch (source + target,
    padding included), beam size and length penalty ``alpha``, validation sentences
    decoded per evaluation, and the test protocol: ``best`` (test BLEU of the best
    validation checkpoint) or ``last5`` (the paper's: each of the last ``last_n`` checkpoints
    decoded with the final beam settings and their BLEU averaged; ``average_weights`` also
    decodes their averaged weights; ``checkpoint_every="epoch"`` saves once per epoch).
    Decoding sorts sources by length and decodes up to ``eval_batch`` sentences together,
    fewer where sentences x beam x (source length rounded up to 32 + the model's max_len)
    would pass ``decode_tokens``; ``decode_dtype="bfloat16"`` decodes a bf16 copy of the
    model (faster on GPU, but the output may differ from fp32's)."""

    src: str = "en"
    tgt: str = "de"
    max_tokens: int = setting(4096, gt=0)
    beam: int = setting(4, gt=0)
    alpha: float = setting(0.6, ge=0)
    eval_sentences: int = setting(500, gt=0)
    protocol: Literal["best", "last5"] = "best"
    eval_batch: int = setting(256, gt=0)
    decode_tokens: int = setting(262144, gt=0)
    decode_dtype: Literal["float32", "bfloat16"] = "float32"
    test_sentences: int = setting(0, ge=0)  # 0: the whole test set
    last_n: int = setting(5, gt=0)
    average_weights: bool = False
    checkpoint_every: Literal["", "epoch"] = ""


def translation_train(preset: str) -> TrainConfig:
    """Vaswani et al. (2017) section 5.3: Adam betas (0.9, 0.98), eps 1e-9, inverse square-root
    decay after 4000 warm-up steps, label smoothing 0.1; lr peak = 512^-0.5 * 4000^-0.5.
    Tiny presets: 300 steps with 100 of warm-up at lr 2e-3."""
    train = TrainConfig(steps=100_000, batch_size=1, lr=7e-4, schedule="inverse_sqrt", warmup_steps=4000,
                        betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0, label_smoothing=0.1,
                        log_every=50, eval_every=2000, save_every=2000, clip_norm=0.0)
    if is_tiny(preset):
        train.steps, train.warmup_steps, train.lr, train.eval_every, train.save_every = 300, 100, 2e-3, 0, 100
        train.log_every = 10
    return train
