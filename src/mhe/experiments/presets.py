"""Comparison presets: the paper's experiments at their published settings, and reduced
versions that fit one GPU for about an hour or one CPU for minutes."""

from __future__ import annotations

from dataclasses import dataclass, field

from mhe.attention import PAPER_KINDS
from mhe.errors import one_of


@dataclass
class Experiment:
    task: str
    preset: str                      # model preset
    data: str = ""
    kinds: tuple = PAPER_KINDS
    seeds: int = 1
    overrides: list = field(default_factory=list)  # --set items applied to every run
    paper: str = ""                  # paper table to set beside ours
    note: str = ""
    metric: str = ""                 # the results.json number the summary reports ("" = the score)


_GPU_MT = ["data.vocab_size=8000",  # Multi30k is small: not the 37K BPE of transformer-base (tasks/vocab.py)
           "train.steps=2000", "train.warmup_steps=600", "train.eval_every=500", "train.save_every=500",
           'data.task_options={"max_tokens": 8192, "eval_sentences": 300}']
_GPU_MLM = ["model.n_layers=6", "model.max_len=128", "data.vocab_size=16384", "train.steps=4000",
            "train.batch_size=64", "train.lr=5e-4", "train.warmup_steps=400", "train.schedule=linear",
            "train.save_every=2000", "train.log_every=50"]
_GPU_LM = ["model.n_layers=6", "model.max_len=256", "data.vocab_size=16384", "train.steps=600",
           "train.batch_size=32", "train.lr=5e-4", "train.warmup_steps=60", "train.schedule=cosine",
           "train.eval_every=100", "train.save_every=100", "train.patience=3", "train.log_every=25",
           "model.dropout=0.1", "model.attn_dropout=0.1"]

EXPERIMENTS = {
    # the main job: built-in data, 2 CPU cores, a few minutes
    "cpu-recall": Experiment("recall", "tiny-decoder", note="multi-query associative recall, generated in-package"),
    "cpu-ptb": Experiment("lm", "tiny-decoder", "ptb", paper="table2-ptb", note="tiny decoder, minutes on a CPU"),
    "cpu-wikitext-2": Experiment("lm", "tiny-decoder", "wikitext-2", paper="table2-wikitext-103",
                                 note="tiny decoder; the paper's row is WikiText-103"),
    # one GPU for about an hour: GPT-2 base head geometry (12 heads of 64), 6 layers, 3 seeds
    # test perplexity: the score uses stride 128 (the paper's 256, capped at half the 256-token
    # window); runs also record perplexity_stride256 (`mhe report DIR --metric perplexity_stride256`)
    "gpu-ptb": Experiment("lm", "gpt2-base", "ptb", seeds=3, overrides=_GPU_LM + ["data.tokenizer=word"],
                          paper="table2-ptb"),
    "gpu-wikitext-2": Experiment("lm", "gpt2-base", "wikitext-2", seeds=3, overrides=_GPU_LM,
                                 paper="table2-wikitext-103"),
    # translation (Table 3 shape) and encoder pre-training (the first stage of Table 1)
    "cpu-multi30k": Experiment("mt", "tiny-encoder-decoder", "multi30k", paper="table3-wmt14",
                               overrides=["data.limit_lines=5000", 'data.task_options={"test_sentences": 200}']),
    "gpu-multi30k": Experiment("mt", "transformer-base", "multi30k", seeds=3, overrides=_GPU_MT,
                               paper="table3-wmt14"),
    "cpu-mlm": Experiment("mlm", "tiny-encoder", "wikitext-2",
                          note="then: mhe compare --task rte --pretrained runs/compare-cpu-mlm"),
    "gpu-mlm": Experiment("mlm", "bert-base", "wikitext-2", overrides=_GPU_MLM,
                          note="BERT-base head geometry, 6 layers; then fine-tune with --pretrained"),
    # the paper's published settings (Appendix B pre-training values; Table 3 WMT-14 100K steps)
    "paper-table1": Experiment("mlm", "bert-base", "wikitext-103", overrides=["train.steps=1000000",
                               "train.batch_size=128"], note="stage 1 of Table 1; then fine-tune with --pretrained"),
    "paper-table3": Experiment("mt", "transformer-base", "wmt14", paper="table3-wmt14",
                               overrides=["train.steps=100000", "train.keep_last=5",
                                          'data.task_options={"protocol": "last5", "checkpoint_every": "epoch"}']),
    "paper-table2": Experiment("lm", "gpt2-base", "wikitext-103", seeds=5, paper="table2-wikitext-103",
                               overrides=["train.steps=1000000", "train.batch_size=128"]),
    "paper-table2-ptb": Experiment("lm", "gpt2-base", "ptb", seeds=5, paper="table2-ptb",
                                   overrides=["train.steps=1000000", "train.batch_size=128"]),
}

# --- Appendix A (FNet/Linear encoders) and Appendix D (size scaling): comparison presets ---
_PRETRAIN = ["train.steps=1000000", "train.batch_size=128"]
_SCALING = ("mha", "mhe-mul")
EXPERIMENTS.update({
    "cpu-fnet-linear": Experiment("mlm", "tiny-encoder", "wikitext-2", kinds=("sha", "mha", "fnet", "linear", "mhe-mul"),
                                  note="token mixing vs attention, minutes on a CPU; then mhe compare --task rte"),
    "paper-fnet-linear": Experiment("mlm", "bert-base", "wikitext-103", kinds=("sha", "mha", "fnet", "linear", "mhe-mul"),
                                    overrides=_PRETRAIN, paper="table1-glue",
                                    note="Appendix A's FNet/Linear rows: pre-train, then fine-tune with --pretrained"),
    "paper-scaling-bert-large": Experiment("mlm", "bert-large", "wikitext-103", kinds=_SCALING, overrides=_PRETRAIN,
                                           paper="tableD-glue-encoder-large",
                                           note="Appendix D 'large'; then fine-tune with --pretrained"),
    "paper-scaling-gpt2-medium": Experiment("lm", "gpt2-medium", "wikitext-103", kinds=_SCALING, seeds=5,
                                            overrides=_PRETRAIN, paper="tableD-wikitext-103-decoder-medium"),
    **{f"paper-scaling-{name}": Experiment(
        "mt", preset, "wmt14", kinds=_SCALING, paper=f"tableD-wmt14-{size}",
        overrides=[f"train.steps={steps}", "train.keep_last=5",
                   'data.task_options={"protocol": "last5", "checkpoint_every": "epoch"}'],
        note="Appendix D, table:seq2seq_scaling")
       for name, preset, size, steps in (
           ("transformer-16x32", "transformer-16x32", "base-16x32", 100_000),
           ("transformer-4x128", "transformer-4x128", "base-4x128", 100_000),
           ("transformer-4l", "transformer-4l", "4l", 100_000), ("transformer-8l", "transformer-8l", "8l", 100_000),
           ("transformer-12h", "transformer-12h", "12h", 100_000),
           ("transformer-big", "transformer-big", "big", 300_000))},
})
DEFAULT = "cpu-recall"


def experiment(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise one_of("comparison preset", name, EXPERIMENTS)
    return EXPERIMENTS[name]
