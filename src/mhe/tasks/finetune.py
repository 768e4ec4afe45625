"""Fine-tuning a pre-trained run on GLUE, SuperGLUE and SQuAD (paper Tables 1-2, 5-7).

``data.task_options`` (:class:`mhe.tasks.finetune_config.FinetuneOptions`): ``task`` (rte, ..., squad-v2),
``checkpoint`` (the pre-training run folder, or one of its checkpoints), ``train_split``/``dev_split`` (default train/dev;
offline SQuAD has no train file, so tests train on a labelled part of dev),
``train_limit``/``dev_limit``, ``doc_stride`` (128), ``max_answer_len`` (30).

The encoder reads ``[CLS] a [SEP] b [SEP]`` with token types and classifies from
[CLS]; the decoder reads ``a [SEP] b [EOS]`` and classifies from its last
non-padding token. Inputs longer than the model are truncated longest-first
(SQuAD contexts are windowed with a document stride instead).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer

from mhe.data.benchmarks import bench_task, read_examples
from mhe.data.tokenize import load_tokenizer, save_tokenizer, special_id, with_pair_template
from mhe.errors import MheError
from mhe.metrics.classification import headline_metric, official_metrics, task_metrics
from mhe.metrics.squad import squad_scores
from mhe.models import ModelConfig, ModelOutput, build_model
from mhe.models.losses import classification_loss
from mhe.progress import bar, each
from mhe.tasks.finetune_config import FinetuneSettings, pretraining_checkpoint
from mhe.tasks.text import pad_rows
from mhe.training.run_files import read_run_record
from mhe.training.weights import load_state_strict, read_sealed_weights


def load_pretrained(path: Path):
    """(model config dict, tokenizer, checkpoint folder) of a pre-training run: the checkpoint
    ``path`` names, or the run's newest complete one."""
    run_dir, weights = pretraining_checkpoint(path)
    return read_run_record(run_dir)["model"], load_tokenizer(run_dir), weights


def load_backbone(model: torch.nn.Module, weights: Path, arch: str) -> None:
    """Start ``model`` from the pre-trained ``weights``: every backbone weight must load
    (same shape); only the new task head may be missing and only the pre-training head
    may be left over (section 4.4: pre-train, then fine-tune)."""
    backbone = "encoder." if arch == "encoder" else "decoder."
    source = read_sealed_weights(weights)
    load_state_strict(model, source, source=weights / "model.safetensors",
                      allow_missing=[k for k in model.state_dict() if not k.startswith(backbone)],
                      allow_unexpected=[k for k in source if not k.startswith(backbone)])


class FinetuneTask(FinetuneSettings):
    higher_is_better = True

    def setup(self, cfg, out: Path, dist):
        o = dataclasses.asdict(cfg.data.task_options)  # FinetuneOptions, checked when the run was built
        if not o["checkpoint"]:
            raise MheError("fine-tuning needs --run (a pre-training run folder)")
        self.cfg, self.o, self.out = cfg, o, out
        self.spec = bench_task(o["task"])
        self.name = self.spec.name
        self.metric = "f1" if self.spec.kind == "span" else headline_metric(self.name)  # the paper's
        model_cfg, tok, weights = load_pretrained(Path(o["checkpoint"]))
        arch = model_cfg["arch"]
        if self.spec.kind == "span" and arch != "encoder":
            raise MheError(f"{self.name} (span extraction) needs an encoder; the checkpoint is a {arch}")
        head = "qa" if self.spec.kind == "span" else "classification"
        n_labels = 1 if self.spec.kind in ("regression", "choice") else max(2, len(self.spec.labels))
        # the pre-trained model, with the run's model settings that differ from the preset
        mc = ModelConfig(**{**model_cfg, "head": head, "num_labels": n_labels, **cfg.model_overrides()})
        self.model_cfg = mc
        model = build_model(mc)
        load_backbone(model, weights, mc.arch)
        self.encoder = mc.arch == "encoder"
        self.tok = tok
        if self.encoder:  # [CLS] a [SEP] b [SEP], truncated longest-first to the model's length
            self.pair_tok = with_pair_template(Tokenizer.from_str(tok.to_str()))
            self.pair_tok.enable_truncation(mc.max_len, strategy="longest_first")
        self.pad = special_id(tok, "[PAD]")
        self.sep, self.eos = special_id(tok, "[SEP]"), special_id(tok, "[EOS]")
        self.max_len = mc.max_len
        d = dict(data_dir=cfg.data.data_dir or None, source=cfg.data.source)
        train = read_examples(self.name, o["train_split"], **d)
        dev = read_examples(self.name, o["dev_split"], **d)
        out.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tok, out)  # only once the data has been read whole
        if o["train_split"] == o["dev_split"]:  # a labelled part stands in for training data
            cut = int(o["dev_offset"]) or len(train) // 2
            train, dev = train[:cut], dev[cut:]
        if o["train_limit"]:
            train = train[: int(o["train_limit"])]
        if o["dev_limit"]:
            dev = dev[: int(o["dev_limit"])]
        self.dev_examples = dev
        self.train_items = self._features(train, training=True)
        self.dev_items = self._features(dev, training=False)
        return model

    # ------------------------------------------------------------------ encoding
    def _pairs(self, pairs: list[tuple[str, str | None]]) -> list[tuple[list[int], list[int]]]:
        if self.encoder:
            inputs = [a if b is None else (a, b) for a, b in pairs]
            return [(e.ids, e.type_ids) for e in self.pair_tok.encode_batch(inputs)]
        return [self._pair(a, b) for a, b in pairs]

    def _pair(self, a: str, b: str | None) -> tuple[list[int], list[int]]:
        ids_a = self.tok.encode(a, add_special_tokens=False).ids
        ids_b = self.tok.encode(b, add_special_tokens=False).ids if b is not None else []
        room = self.max_len - (2 if b is not None else 1)
        while len(ids_a) + len(ids_b) > room:  # longest first
            (ids_a if len(ids_a) >= len(ids_b) else ids_b).pop()
        ids = ids_a + ([self.sep] + ids_b if b is not None else []) + [self.eos]
        return ids, [0] * len(ids)

    def _features(self, examples, *, training: bool) -> list[dict]:
        kind = self.spec.kind
        if kind == "span":
            return self._span_features(examples, training=training)
        feats = []
        if kind == "choice":
            enc = self._pairs([(ex.text_a, c) for ex in examples for c in ex.choices])
            for i, ex in enumerate(examples):
                pairs = enc[2 * i: 2 * i + 2]
                feats.append({"ids": [p[0] for p in pairs], "types": [p[1] for p in pairs], "label": ex.label, "ex": i})
            return feats
        enc = self._pairs([(ex.text_a, ex.text_b) for ex in examples])
        for i, (ex, (ids, types)) in enumerate(zip(examples, enc)):
            feats.append({"ids": ids, "types": types, "label": ex.label, "ex": i})
        return feats

    def _span_features(self, examples, *, training: bool) -> list[dict]:
        """Windows over the context with a document stride; the answer's token span, or
        [CLS] (index 0) when the window does not hold it or the question has none."""
        tok = with_pair_template(Tokenizer.from_str(self.tok.to_str()))
        stride = int(self.o["doc_stride"])
        feats = []
        for i, ex in enumerate(examples):
            q_len = len(tok.encode(ex.text_a, add_special_tokens=False).ids)
            room = self.max_len - q_len - 3
            if room < 16:
                raise MheError(f"question {ex.uid} leaves no room for context in {self.max_len} tokens")
            tok.enable_truncation(self.max_len, strategy="only_second", stride=min(stride, room // 2))
            enc = tok.encode(ex.text_a, ex.text_b)
            tok.no_truncation()
            for w in [enc] + list(enc.overflowing):
                seq = w.sequence_ids
                ctx = [j for j, s in enumerate(seq) if s == 1]
                start = end = 0
                if ex.answers and training:
                    text, c0 = ex.answers[0]
                    c1 = c0 + len(text)
                    if w.offsets[ctx[0]][0] <= c0 and w.offsets[ctx[-1]][1] >= c1:
                        start = next(j for j in ctx if w.offsets[j][1] > c0)
                        end = next(j for j in reversed(ctx) if w.offsets[j][0] < c1)
                feats.append({"ids": w.ids, "types": w.type_ids, "start": start, "end": end, "ex": i,
                              "offsets": w.offsets, "context": ctx})
        return feats

    # ------------------------------------------------------------------ batches
    def n_train_items(self):
        return len(self.train_items)

    def _batch(self, feats):
        if self.spec.kind == "choice":
            ids = [x for f in feats for x in f["ids"]]
            types = [x for f in feats for x in f["types"]]
        else:
            ids, types = [f["ids"] for f in feats], [f["types"] for f in feats]
        input_ids = pad_rows(ids, self.pad)
        batch = {"input_ids": input_ids, "attention_mask": input_ids != self.pad,
                 "token_type_ids": pad_rows(types, 0)}
        if self.spec.kind == "span":
            batch["start"] = torch.tensor([f["start"] for f in feats])
            batch["end"] = torch.tensor([f["end"] for f in feats])
        else:
            dtype = torch.float32 if self.spec.kind == "regression" else torch.long
            batch["labels"] = torch.tensor([f["label"] for f in feats], dtype=dtype)
        return batch

    def collate(self, indices):
        batch = self._batch([self.train_items[i] for i in indices])
        return {**batch, "n_tokens": int(batch["attention_mask"].sum())}  # counted on the host: no device sync

    def _forward(self, model, batch):
        if self.spec.kind == "span":
            return model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                         start_positions=batch.get("start"), end_positions=batch.get("end"))
        kw = {"token_type_ids": batch["token_type_ids"]} if self.encoder else {}
        if self.spec.kind == "choice":
            logits = model(batch["input_ids"], batch["attention_mask"], **kw).logits.view(-1, 2)
            loss = classification_loss(logits, batch["labels"], 2)  # which of the two choices
            return ModelOutput(logits, loss)
        return model(batch["input_ids"], batch["attention_mask"], labels=batch["labels"], **kw)

    def loss(self, model, batch, *, chunked_loss=None):  # classification and span heads: no chunked loss
        out = self._forward(model, batch)
        return out.loss, batch["n_tokens"]

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, model, *, progress: bool = False):
        """Dev-set metrics; ``progress``: count the batches (and SQuAD's post-processing) on bars."""
        model.eval()
        dev = next(model.parameters()).device
        bs = self.cfg.data.eval_batch_size * 2
        logits = []
        with bar(len(self.dev_items), desc=f"evaluating {self.name}", unit="example", enabled=progress) as shown:
            for k in range(0, len(self.dev_items), bs):
                b = self.to(self._batch(self.dev_items[k:k + bs]), dev)
                inputs = {kk: v for kk, v in b.items() if kk not in ("start", "end")}
                logits.append(self._forward(model, inputs).logits.float().cpu())
                shown.update(len(self.dev_items[k:k + bs]))
        if self.spec.kind == "span":
            return self._squad_eval(logits, progress=progress)
        out = torch.cat(logits)
        gold = [f["label"] for f in self.dev_items]
        pred = out.squeeze(-1).tolist() if self.spec.kind == "regression" else out.argmax(-1).tolist()
        extra = {}
        if self.name == "multirc":
            extra["question_ids"] = [self.dev_examples[f["ex"]].group for f in self.dev_items]
        res = task_metrics(self.name, pred, gold, **extra)
        return {k: v for k, v in res.items() if k not in ("metric", "score", "official")} | {self.metric: res["score"]}

    @torch.no_grad()
    def predict(self, model, examples) -> list[int]:
        """Label ids the model predicts for ``examples`` of this task's kind (e.g. the SuperGLUE
        diagnostics AX-b and AX-g with a model fine-tuned on RTE)."""
        model.eval()
        dev = next(model.parameters()).device
        feats = self._features(examples, training=False)
        bs = self.cfg.data.eval_batch_size * 2
        logits = [self._forward(model, self.to(self._batch(feats[k:k + bs]), dev)).logits.float().cpu()
                  for k in range(0, len(feats), bs)]
        return torch.cat(logits).argmax(-1).tolist()

    def _squad_eval(self, logits, *, progress: bool = False) -> dict:
        max_ans = int(self.o["max_answer_len"])
        best: dict[int, tuple[float, str]] = {}
        null: dict[int, float] = {}
        feats = self.dev_items
        flat = [row for chunk in logits for row in chunk]
        for f, lg in each(zip(feats, flat), total=len(feats), desc="SQuAD answers", unit="feature",
                          enabled=progress):
            start, end = lg[:, 0], lg[:, 1]
            i = f["ex"]
            ctx = f["context"]
            null[i] = min(null.get(i, math.inf), float(start[0] + end[0]))
            n = min(20, len(ctx))
            top_s = sorted(ctx, key=lambda j: -float(start[j]))[:n]
            top_e = sorted(ctx, key=lambda j: -float(end[j]))[:n]
            ex = self.dev_examples[i]
            for s in top_s:
                for e in top_e:
                    if e < s or e - s + 1 > max_ans:
                        continue
                    score = float(start[s] + end[e])
                    if i not in best or score > best[i][0]:
                        best[i] = (score, ex.text_b[f["offsets"][s][0]:f["offsets"][e][1]])
        v2 = self.name == "squad-v2"
        preds, golds = {}, {}
        for i, ex in enumerate(self.dev_examples):
            span_score, text = best.get(i, (-math.inf, ""))
            preds[ex.uid] = "" if (v2 and null.get(i, -math.inf) > span_score) else text
            golds[ex.uid] = [a for a, _ in ex.answers]
        return squad_scores(preds, golds, version="v2.0" if v2 else "v1.1")

    def final(self, model):
        res = self.evaluate(model, progress=self.cfg.train.progress)
        official = ["exact_match", "f1"] if self.spec.kind == "span" else official_metrics(self.name)
        return {"split": self.o["dev_split"], "task_name": self.name, "score": res[self.metric], **res,
                "metric": self.metric, "official_metrics": official}  # metric: the paper's headline
