"""Run configuration: nested dataclasses, dotted ``--set`` overrides, a stable hash.

Defaults follow the paper's Appendix B for each phase; tiny presets get short
schedules that run on a CPU in minutes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from mhe.errors import MheError, one_of


@dataclass
class TrainConfig:
    """Optimisation and cadence (Appendix B, Table 11: pre-training)."""

    steps: int = 1_000_000           # the schedule's horizon
    epochs: float = 0                # if > 0: steps = epochs x (training items // batch_size);
                                     # --set train.steps=N turns epochs off (the later of the two wins)
    batch_size: int = 32             # global batch (split over GPUs)
    grad_accum: int = 1
    lr: float = 1e-4
    schedule: str = "linear"         # linear | cosine | cosine_restarts | constant | inverse_sqrt
    warmup_steps: int = 10_000
    warmup_ratio: float = 0.0        # if > 0, warmup = ratio * steps (fine-tuning: 6%)
    restarts: int = 1                # cycles of cosine_restarts
    betas: tuple = (0.9, 0.9999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    label_smoothing: float = 0.0
    init_from: str = ""              # a run directory: start from its weights and tokenizer (tasks/init_from.py)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0              # 0: only at the end
    save_every: int = 0              # 0: only at the end
    keep_last: int = 2
    keep_checkpoints: bool = True    # false: once results.json exists, delete checkpoints/ and best/
    stop_at: int = 0                 # end this invocation at this step (the schedule keeps `steps`)
    patience: int = 0                # early stopping: evaluations without improvement (0: off)
    precision: str = "auto"          # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    compile: bool = False
    progress: bool = True
    tensorboard: bool = False
    device: str = "auto"


# train.* settings that change how a run is carried out, not what it computes: outside the hash
OPERATIONAL_TRAIN_KEYS = ("stop_at", "log_every", "eval_every", "save_every", "keep_last", "keep_checkpoints",
                          "progress", "tensorboard", "device", "compile")


@dataclass
class DataConfig:
    """Which data and how it is cut."""

    dataset: str = ""
    data_dir: str = ""
    source: str = "local"            # local | hub
    tokenizer: str = ""              # bpe | wordpiece | word ("" = the task's convention)
    vocab_size: int = 0              # 0 = the task's default
    seq_len: int = 0                 # 0 = the model's max_len
    eval_stride: int = 256           # sliding-window perplexity (section 4.5)
    eval_batch_size: int = 16
    limit_lines: int = 0             # read at most this many lines per split (0 = all)
    task_options: dict = field(default_factory=dict)


@dataclass
class RunConfig:
    task: str
    preset: str
    attention: str = "mha"
    model: dict = field(default_factory=dict)  # ModelConfig overrides
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RunConfig":
        d = dict(d)
        train = TrainConfig(**{**d.pop("train", {})})
        train.betas = tuple(train.betas)
        return cls(train=train, data=DataConfig(**d.pop("data", {})), **d)

    def identity(self) -> dict:
        """What makes two runs the same run (cadence, stop_at and progress bars aside)."""
        d = self.to_dict()
        for k in OPERATIONAL_TRAIN_KEYS:
            d["train"].pop(k, None)
        d["data"].pop("data_dir", None)
        d["data"].pop("eval_batch_size", None)
        return d

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]


def parse_value(text: str):
    """``--set`` values: JSON when it parses (numbers, true/false, lists), else the string."""
    try:
        return json.loads(text)
    except ValueError:
        low = text.lower()
        if low in ("true", "false"):
            return low == "true"
        return text


def apply_overrides(cfg: RunConfig, items: list[str]) -> RunConfig:
    """Apply ``section.key=value`` items; unknown keys list the valid ones."""
    from mhe.models.config import ModelConfig

    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for item in items or []:
        if "=" not in item:
            raise MheError(f"--set takes KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        value = parse_value(raw)
        section, _, name = key.partition(".")
        if section == "model":
            if name not in model_fields:
                raise MheError(f"unknown --set key {key!r}; valid model keys: {', '.join(sorted(model_fields))}")
            cfg.model[name] = value
        elif section in ("train", "data"):
            target = getattr(cfg, section)
            valid = [f.name for f in dataclasses.fields(target)]
            if name not in valid:
                raise MheError(f"unknown --set key {key!r}; valid {section} keys: {', '.join(valid)}")
            current = getattr(target, name)
            if isinstance(current, bool) and not isinstance(value, bool):
                raise MheError(f"--set {key} takes true or false, got {raw!r}")
            if isinstance(current, (int, float)) and not isinstance(current, bool):
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise MheError(f"--set {key} takes a number, got {raw!r}")
                value = type(current)(value) if not (isinstance(current, int) and isinstance(value, float)
                                                     and not value.is_integer()) else value
            if isinstance(current, tuple):
                value = tuple(value)
            if isinstance(current, dict):
                if not isinstance(value, dict):
                    raise MheError(f"--set {key} takes a JSON object, got {raw!r}")
                value = {**current, **value}  # successive --set items merge
            setattr(target, name, value)
            if section == "train" and name == "steps":
                cfg.train.epochs = 0  # an explicit step count wins over (fine-tuning's default) epochs
        else:
            raise one_of("--set section", section, ("train", "data", "model"))
    validate(cfg)
    return cfg


SCHEDULES = ("linear", "cosine", "cosine_restarts", "constant", "inverse_sqrt")
PRECISIONS = ("auto", "fp32", "bf16")


def validate(cfg: RunConfig) -> None:
    t = cfg.train
    if t.schedule not in SCHEDULES:
        raise one_of("schedule", t.schedule, SCHEDULES)
    if t.precision not in PRECISIONS:
        raise one_of("precision", t.precision, PRECISIONS)
    for name in ("steps", "batch_size", "grad_accum"):
        if getattr(t, name) <= 0:
            raise MheError(f"train.{name} must be positive, got {getattr(t, name)}")
    if t.lr <= 0:
        raise MheError(f"train.lr must be positive, got {t.lr}")
    if t.stop_at < 0 or t.warmup_steps < 0:
        raise MheError("train.stop_at and train.warmup_steps must be >= 0")
