"""Each task owns its options and defaults (``Task.options``, ``Task.default_config``): every
option and default that moved there is checked to take effect, so a task that silently
ignored one (translation's loss dropping ``train.label_smoothing``, say) fails here."""

import dataclasses

import pytest
import torch

from conftest import require_data
from mhe.data.bench_types import Example
from mhe.data.parallel_text import read_parallel
from mhe.data.tokenize import train_tokenizer
from mhe.models import build_model
from mhe.tasks import TASKS, default_run
from mhe.tasks.finetune import FinetuneTask
from mhe.tasks.finetune_config import FinetuneOptions
from mhe.tasks.recall import RecallOptions, RecallTask
from mhe.tasks.translation import TranslationTask
from mhe.tasks.translation_config import TranslationOptions
from mhe.training.config import apply_overrides
from mhe.training.distributed import Dist


def test_every_task_names_its_options_and_command():
    assert {n: (c.options, c.command) for n, c in TASKS.items() if n in ("recall", "mt", "finetune")} == {
        "recall": (RecallOptions, "train"), "mt": (TranslationOptions, "train-mt"),
        "finetune": (FinetuneOptions, "finetune")}
    for name, cls in TASKS.items():
        assert cls.name == name and cls.summary
        assert isinstance(default_run(name, "tiny-encoder" if name == "mlm" else "tiny-decoder", "mha",
                                      "rte" if name == "finetune" else "").data.task_options, cls.options)


# ---------------------------------------------------------------- defaults, literal values
def test_the_defaults_of_each_task():
    lm = default_run("lm", "tiny-decoder", "mha", "wikitext-2")
    assert (lm.train.steps, lm.train.batch_size, lm.train.lr, lm.model.max_len, lm.data.tokenizer) == \
        (600, 16, 1e-3, 64, "word")  # 16 x 64 tokens a step; the tokenised WikiText-2 is word level
    assert default_run("lm", "tiny-decoder", "mha", "ptb").data.tokenizer == ""
    mlm = default_run("mlm", "tiny-encoder", "mha", "ptb")
    assert (mlm.train.batch_size, mlm.model.max_len) == (16, 64)
    full = default_run("lm", "gpt2-base", "mha", "ptb")  # Appendix B pre-training
    assert (full.train.lr, full.train.warmup_steps, full.train.betas, full.train.weight_decay) == \
        (1e-4, 10_000, (0.9, 0.9999), 0.01) and full.model.max_len == 512
    recall = default_run("recall", "tiny-decoder", "mqa")
    assert (recall.train.steps, recall.train.lr, recall.train.betas, recall.model.d_model, recall.model.dropout) == \
        (1000, 3e-3, (0.9, 0.98), 64, 0.0) and recall.model.attention == "mqa"
    mt = default_run("mt", "transformer-base", "mha", "multi30k")  # Vaswani et al. section 5.3
    assert (mt.train.schedule, mt.train.warmup_steps, mt.train.betas, mt.train.eps, mt.train.label_smoothing) == \
        ("inverse_sqrt", 4000, (0.9, 0.98), 1e-9, 0.1)
    assert (default_run("mt", "tiny-encoder-decoder").train.steps, default_run("mt", "tiny-encoder-decoder").train.lr) \
        == (300, 2e-3)
    ft = default_run("finetune", "tiny-encoder", "mha", "cb")  # Appendix B fine-tuning, SuperGLUE
    assert (ft.train.lr, ft.train.schedule, ft.train.epochs, ft.train.eval_every, ft.data.task_options.task) == \
        (5e-5, "cosine_restarts", 20, 5, "cb")
    assert default_run("finetune", "tiny-encoder", "mha", "rte").train.lr == 3e-5


# ---------------------------------------------------------------- recall's options
def test_every_recall_option_shapes_the_data():
    opts = RecallOptions(n_keys=6, n_values=5, pairs=3, queries=2, train_size=40, test_size=12, data_seed=7)
    cfg = apply_overrides(default_run("recall", "tiny-decoder"), [])
    cfg.data.task_options = opts
    task = RecallTask()
    model = task.setup(cfg, None, Dist())
    assert task.x.shape == (40, 2 * (3 + 2)) and task.tx.shape == (12, 10)
    assert model.cfg.vocab_size == 6 + 5 + 1
    keys, values = task.x[:, 0:6:2], task.x[:, 1:6:2]
    assert keys.min() >= 1 and keys.max() <= 6 and values.min() >= 7 and values.max() <= 11
    assert int((task.y != -100).sum(1).max()) == 2  # two queried values per sequence
    other = RecallTask()
    cfg.data.task_options = dataclasses.replace(opts, data_seed=8)
    other.setup(cfg, None, Dist())
    assert not torch.equal(other.x, task.x)


# ---------------------------------------------------------------- translation's settings
def _tiny_translation(**options):
    texts = ["a man rides a bike .", "two dogs play in the snow .", "a girl reads a book ."] * 4
    task = TranslationTask()
    task.tok = train_tokenizer("bpe", texts, 120)
    cfg = default_run("mt", "tiny-encoder-decoder")
    cfg.data.task_options = TranslationOptions(**options)
    task.cfg, task.o = cfg, dataclasses.asdict(cfg.data.task_options)
    model = task._build_model(cfg).eval()
    return model, task, texts


def _smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, eps: float) -> float:
    """Label-smoothed cross-entropy written out: (1 - eps) * -log p(y) + eps * mean over v of -log p(v)."""
    logp = torch.log_softmax(logits.double(), -1)
    total, n = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            y = int(labels[b, t])
            if y != -100:
                total += (1 - eps) * -logp[b, t, y].item() + eps * -logp[b, t].mean().item()
                n += 1
    return total / n


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_translation_loss_uses_train_label_smoothing(eps):
    model, task, texts = _tiny_translation()
    task.cfg.train.label_smoothing = eps
    task.max_len = model.cfg.max_len
    task.src_ids = [task._encode(s) for s in texts[:4]]
    task.tgt_ids = [task._encode(s) for s in texts[1:5]]
    task.batches = [[0, 1, 2, 3]]
    batch = task.collate([0])
    loss, n = task.loss(model, batch)
    logits = model(batch["src"], batch["tgt"], batch["src_mask"], batch["tgt_mask"]).logits
    assert n == int((batch["labels"] != -100).sum())
    assert loss.item() == pytest.approx(_smoothed_loss(logits, batch["labels"], eps), rel=1e-5)


def test_translation_decodes_with_the_options_beam_and_alpha(monkeypatch):
    model, task, texts = _tiny_translation(beam=3, alpha=1.5)
    seen = []
    real = TranslationTask.translate.__globals__["beam_search"]

    def spy(*args, **kw):
        seen.append((kw["beam"], kw["alpha"]))
        return real(*args, **kw)

    monkeypatch.setitem(TranslationTask.translate.__globals__, "beam_search", spy)
    task.translate(model, texts[:2])
    task.translate(model, texts[:2], beam=2, alpha=0.0)  # the command line's values win
    assert seen == [(3, 1.5), (2, 0.0)]


def test_translation_reads_the_options_languages_limits_and_budget(monkeypatch, tmp_path):
    root = require_data("multi30k/train.en.gz", "multi30k/val.de.gz", "multi30k/test_2016_flickr.de.gz")
    cfg = default_run("mt", "tiny-encoder-decoder", "mha", "multi30k")
    cfg = apply_overrides(cfg, ["data.limit_lines=60", "data.vocab_size=200", "train.progress=false",
                                'data.task_options={"src": "de", "tgt": "en", "max_tokens": 300, '
                                '"eval_sentences": 7, "test_sentences": 5}'])
    cfg.data.data_dir = str(root)
    task = TranslationTask()
    model = task.setup(cfg, tmp_path, Dist()).eval()
    assert task.valid == read_parallel("multi30k", "valid", "de", "en", data_dir=root)  # German to English
    for batch in task.batches:  # the token budget per batch
        rows = len(batch)
        longest = max(len(task.src_ids[i]) for i in batch) + max(len(task.tgt_ids[i]) + 1 for i in batch)
        assert rows * longest <= 300 or rows == 1
    decoded = []
    monkeypatch.setattr(task, "translate", lambda m, src, **kw: decoded.append((len(src), kw)) or [""] * len(src))
    task.evaluate(model)
    assert decoded == [(7, {"beam": 1})] and len(task._test()[0]) == 5  # validation BLEU: greedy


# ---------------------------------------------------------------- fine-tuning's options
def _span_task(**options):
    text = " ".join(f"w{i}" for i in range(60))
    task = FinetuneTask()
    task.tok = train_tokenizer("wordpiece", [text, "who is it ?"], 200)
    task.max_len = 32
    task.o = dataclasses.asdict(FinetuneOptions(task="squad", **options))
    return task, [Example("who is it ?", text, uid="q", answers=[("w50", text.index("w50"))])]


def test_doc_stride_sets_the_overlap_of_squad_windows():
    counts = {}
    for stride in (4, 12):
        task, examples = _span_task(doc_stride=stride)
        counts[stride] = len(task._span_features(examples, training=True))
    assert counts[12] > counts[4] > 1  # the stride is the overlap (tokenizers, HF): more of it, more windows


ELEVEN = "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10"  # the likeliest span: 11 tokens


@pytest.mark.parametrize("max_answer_len, answer", [(3, "w0 w1"), (10, "w0 w1"), (11, ELEVEN), (30, ELEVEN)])
def test_max_answer_len_bounds_the_predicted_span(max_answer_len, answer, monkeypatch):
    task, examples = _span_task(max_answer_len=max_answer_len)
    task.dev_examples = examples
    task.dev_items = task._span_features(examples, training=False)[:1]
    task.name = "squad"
    ctx = task.dev_items[0]["context"]
    logits = torch.full((len(task.dev_items[0]["ids"]), 2), -5.0)
    logits[ctx[0], 0] = 5.0   # the likeliest start and end are 11 tokens apart ...
    logits[ctx[10], 1] = 5.0
    logits[ctx[1], 1] = 1.0   # ... the best end within three tokens of the start is the next one
    picked = {}
    monkeypatch.setitem(FinetuneTask._squad_eval.__globals__, "squad_scores",
                        lambda preds, golds, version: picked.update(preds) or {"f1": 0.0})
    task._squad_eval([logits[None]])
    assert picked == {"q": answer}
