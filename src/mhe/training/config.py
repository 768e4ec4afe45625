"""Run configuration: one typed tree (run -> model, train, data), dotted ``--set`` overrides
checked by type and range before any work starts, and a stable hash.

``RunConfig.model`` is a :class:`~mhe.models.ModelConfig` (the preset with the run's
overrides) and holds the only copy of the attention kind and its typed options; the
task fills in what the data decides (vocabulary size, padding id, head). Defaults
follow the paper's Appendix B for each phase; tiny presets get short schedules that
run on a CPU in minutes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from mhe.errors import MheError, one_of
from mhe.models.config import ModelConfig, preset
from mhe.output_paths import portable_path
from mhe.settings import build, check_fields, field_types, parse_text, set_path, setting, typed_options

if TYPE_CHECKING:  # settings are read and checked without torch (the mhe command's setting errors)
    import torch

Schedule = Literal["linear", "cosine", "cosine_restarts", "constant", "inverse_sqrt"]
Precision = Literal["auto", "fp32", "bf16"]
Parallel = Literal["auto", "ddp", "fsdp"]
Checkpointing = Literal["none", "full", "selective"]
GradReduce = Literal["float32", "bf16"]
EvalPrecision = Literal["tf32", "float32", "train"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
PRECISIONS: tuple[str, ...] = get_args(Precision)
DEVICE_PATTERN = r"auto|cpu|mps|cuda(:\d+)?"
MIGRATE = "python benchmarks/results_tools.py migrate"  # converts run folders saved in earlier layouts


@dataclass
class TrainConfig:
    """Optimisation and cadence (Appendix B, Table 11: pre-training)."""

    steps: int = setting(1_000_000, gt=0)      # the schedule's horizon
    epochs: float = setting(0.0, ge=0)         # if > 0: steps = epochs x (training items // batch_size);
                                               # --set train.steps=N turns epochs off (the later of the two wins)
    batch_size: int = setting(32, gt=0)        # global batch (split over GPUs)
    grad_accum: int = setting(1, gt=0)
    lr: float = setting(1e-4, gt=0)
    schedule: Schedule = "linear"
    warmup_steps: int = setting(10_000, ge=0)
    warmup_ratio: float = setting(0.0, ge=0, le=1)  # if > 0, warmup = ratio * steps (fine-tuning: 6%)
    restarts: int = setting(1, gt=0)           # cycles of cosine_restarts
    betas: tuple[float, float] = setting((0.9, 0.9999), ge=0, lt=1)
    eps: float = setting(1e-8, gt=0)
    weight_decay: float = setting(0.01, ge=0)
    clip_norm: float = setting(1.0, ge=0)      # 0: no clipping
    label_smoothing: float = setting(0.0, ge=0, lt=1)
    init_from: str = ""                         # a run directory: start from its weights and tokenizer (tasks/init_from.py)
    distill_from: str = ""                      # lm: a run directory whose logits the model also learns (tasks/distill.py)
    distill_weight: float = setting(0.5, ge=0, le=1)  # loss = (1 - w) * cross-entropy + w * T^2 * KL(teacher || model)
    distill_temperature: float = setting(1.0, gt=0)   # T: both distributions softened by it
    seed: int = setting(0, ge=0)
    log_every: int = setting(10, gt=0)
    eval_every: int = setting(0, ge=0)         # 0: only at the end
    save_every: int = setting(0, ge=0)         # 0: only at the end
    keep_last: int = setting(2, gt=0)
    keep_checkpoints: bool = True              # false: once results.json exists, delete checkpoints/ and best/
    stop_at: int = setting(0, ge=0)            # end this invocation at this step (the schedule keeps `steps`)
    patience: int = setting(0, ge=0)           # early stopping: evaluations without improvement (0: off)
    precision: Precision = "auto"              # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    compile: bool | Literal["auto"] = "auto"   # torch.compile the model; auto: on CUDA (compile_wanted)
    cuda_graphs: bool | Literal["auto"] = "auto"  # replay the compiled step as CUDA graphs; auto: for
                                               # fixed-shape batches (pre-training) on CUDA (parallelize.cuda_graphs_wanted)
    deterministic: bool = False                # torch's deterministic kernels, compiled ones too: the same bits
                                               # run after run and on resume, at some speed (state.deterministic_kernels)
    parallel: Parallel = "auto"                # several processes: ddp (auto) copies the model, fsdp shards it
    grad_reduce: GradReduce = "float32"        # DDP's gradient all-reduce; bf16: each bucket cast to bf16 for the
                                               # wire (half the bytes; the averaged gradients carry bf16 rounding),
                                               # torch's bf16_compress_hook (PyTorch docs: DDP Communication Hooks);
                                               # no effect on one process, nor without CUDA and NCCL, which torch's
                                               # hook needs (noted); refused under fsdp (training/parallelize.py)
    activation_checkpointing: Checkpointing = "none"  # full: recompute every block's activations in the
                                               # backward pass; selective: every other block (training/activation_checkpointing.py)
    progress: bool = True
    tensorboard: bool = False
    device: str = "auto"                       # auto | cpu | cuda | cuda:N | mps


DISTILL_KEYS = ("distill_from", "distill_weight", "distill_temperature")
"""Distillation's settings: in the hash only when ``distill_from`` is set, so the hashes of runs
without it are those recorded before distillation existed."""

# train.* settings that change how a run is carried out, not what it computes: outside the hash
OPERATIONAL_TRAIN_KEYS = ("stop_at", "log_every", "eval_every", "save_every", "keep_last", "keep_checkpoints",
                          "progress", "tensorboard", "device", "compile", "cuda_graphs", "deterministic", "parallel",
                          "activation_checkpointing")


@dataclass(frozen=True)
class NoTaskOptions:
    """The options of a task that has none of its own (lm, mlm: every setting lives in ``data.*``)."""


@dataclass
class DataConfig:
    """Which data and how it is cut; ``task_options`` are the task's own typed options, an
    instance of the task's ``options`` class (``mhe.tasks.TASKS``; None: no options)."""

    dataset: str = ""
    data_dir: str = ""
    source: Literal["local", "hub"] = "local"
    tokenizer: Literal["", "bpe", "wordpiece", "word"] = ""  # "" = the task's convention
    vocab_size: int = setting(0, ge=0)         # 0 = the task's default
    seq_len: int = setting(0, ge=0)            # 0 = the model's max_len
    eval_stride: int = setting(256, gt=0)      # sliding-window perplexity (section 4.5)
    eval_second_stride: int = setting(0, ge=0)  # 0 = the final evaluation is one pass; N = also stride N
    eval_batch_size: int = setting(16, gt=0)
    eval_precision: EvalPrecision = "tf32"     # float32 with TF32 products on a GPU; float32: IEEE products;
                                               # train: under train.precision's autocast (training.step.evaluation_precision)
    limit_lines: int = setting(0, ge=0)        # read at most this many lines per split (0 = all)
    task_options: object = None


@dataclass
class RunConfig:
    """One run: the task, the model preset and its resolved :class:`ModelConfig`, training
    and data settings. ``model`` defaults to the preset; ``model.attention`` is the kind.
    ``preset`` "" names no preset: the model's sizes are its own (a converted Hugging Face
    checkpoint), and ``model`` is given."""

    task: str
    preset: str
    model: ModelConfig | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task:
            raise MheError(f"a run needs a task name, got {self.task!r}")
        if self.model is None:
            self.model = preset(self.preset)
        validate(self)

    @property
    def kind(self) -> str:
        """The attention kind of every sublayer (``model.attention``)."""
        return self.model.attention

    def model_overrides(self) -> dict:
        """The model settings that differ from the preset's (kind and its options aside)."""
        if not self.preset:
            return {}  # no preset: the model is its own
        base = preset(self.preset)
        return {f.name: _plain(getattr(self.model, f.name)) for f in dataclasses.fields(ModelConfig)
                if f.name not in ("attention", "attn_options") and getattr(self.model, f.name) != getattr(base, f.name)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def record(self) -> dict:
        """:meth:`to_dict` as a run folder records it (``run.json``, ``config.json``'s ``run``): the
        data folder relative to the working folder where it lies inside it
        (:func:`mhe.output_paths.portable_path`); it is no part of :meth:`identity`, so hashes agree."""
        d = self.to_dict()
        d["data"]["data_dir"] = portable_path(d["data"]["data_dir"])
        return d

    def identity(self) -> dict:
        """What makes two runs the same run: the task, the preset, the whole model (kind and
        options included) and every training and data setting that changes what is computed.
        Left out: cadence, devices and wrapping (``OPERATIONAL_TRAIN_KEYS``), where the data
        are read from, the evaluation batch and precision (they change how evaluations round, not
        what is trained) and the second evaluation stride (it adds a figure to results.json and
        changes no other). Hashes of earlier layouts are rewritten by
        ``benchmarks/results_tools.py migrate``."""
        train = dataclasses.asdict(self.train)
        for k in OPERATIONAL_TRAIN_KEYS + (() if self.train.distill_from else DISTILL_KEYS):
            train.pop(k)
        data = dataclasses.asdict(self.data)
        for k in ("data_dir", "eval_batch_size", "eval_second_stride", "eval_precision"):
            data.pop(k)
        return {"task": self.task, "preset": self.preset, "model": self.model.to_dict(), "train": train, "data": data}

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:16]


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def from_dict(d: dict, task_options: type) -> RunConfig:
    """A :class:`RunConfig` from its saved dict (config.json's ``run``, run.json); bad fields are
    one-line errors. ``task_options`` is the class of the task's options
    (``mhe.tasks.run_config_from_dict`` looks it up by the task's name)."""
    if not isinstance(d, dict):
        raise MheError(f"a run configuration must be a JSON object, got {type(d).__name__}")
    d = dict(d)
    valid = ("task", "preset", "attention", "model", "train", "data")  # attention: refused below
    for k in d:
        if k not in valid:
            raise MheError(f"unknown run configuration key {k!r}; valid keys: {', '.join(valid)}")
    for k in ("task", "preset"):
        if not isinstance(d.get(k), str):
            raise MheError(f"the run configuration needs {k!r} (a string), got {d.get(k)!r}")
    model = d.get("model") or {}
    if not isinstance(model, dict):
        raise MheError(f"the run configuration's 'model' must be a JSON object, got {model!r}")
    if "attention" in d or "arch" not in model:
        raise MheError(f"saved in an earlier layout (the attention kind beside model overrides); convert it with: "
                       f"{MIGRATE} RUN_FOLDER")
    model = build(ModelConfig, model, "model")
    data = dict(d.get("data") or {})
    opts = typed_options(task_options, data.pop("task_options", None), "data.task_options", f"task {d['task']!r}")
    return RunConfig(task=d["task"], preset=d["preset"], model=model,
                     train=build(TrainConfig, d.get("train") or {}, "train"),
                     data=build(DataConfig, {**data, "task_options": opts}, "data"))


def validate(cfg: RunConfig) -> None:
    """Check every setting of ``cfg`` (types, finiteness, ranges, allowed values) and the
    rules between them; normalise the typed options. Raises a one-line :class:`MheError`."""
    if cfg.preset or not isinstance(cfg.model, ModelConfig):
        preset(cfg.preset)
    if not isinstance(cfg.model, ModelConfig):
        raise MheError(f"model must be a ModelConfig, got {type(cfg.model).__name__}")
    cfg.model = cfg.model.replace()  # runs the model's own checks after field-by-field edits
    check_fields(cfg.train, "train")
    if cfg.data.task_options is None:
        cfg.data.task_options = NoTaskOptions()
    if not dataclasses.is_dataclass(cfg.data.task_options) or isinstance(cfg.data.task_options, type):
        raise MheError(f"data.task_options of a {cfg.task!r} run must be the task's typed options "
                       f"(mhe.tasks.TASKS[{cfg.task!r}].options), got {type(cfg.data.task_options).__name__}")
    check_fields(cfg.data, "data")
    check = getattr(cfg.data.task_options, "check", None)
    if check:
        check()
    t = cfg.train
    if not re.fullmatch(DEVICE_PATTERN, t.device):
        raise MheError(f"train.device={t.device!r} is not allowed; train.device takes auto, cpu, cuda, cuda:N or mps")
    if t.grad_reduce == "bf16" and t.parallel == "fsdp":
        raise MheError("train.grad_reduce='bf16' is not allowed with train.parallel=fsdp (FSDP reduces its gradients "
                       "in float32, mhe.training.fsdp); train.grad_reduce takes float32 there, bf16 only under ddp")
    if t.distill_from and cfg.task != "lm":
        raise MheError(f"train.distill_from is for causal language modelling (task lm) only, not task {cfg.task!r}")
    if t.cuda_graphs is True and t.grad_accum > 1:
        raise MheError(f"train.cuda_graphs=true needs train.grad_accum=1, got {t.grad_accum} (a replayed backward "
                       "reuses the memory the accumulated gradients would live in); set train.cuda_graphs=auto or false")


def compile_wanted(t: TrainConfig, device: torch.device) -> bool:
    """Whether a run compiles its model: ``train.compile`` true or false, or ``auto``: on CUDA
    (where the compiled step is about twice as fast, docs/benchmarks.md) and not on a CPU, where
    compiling costs more than it saves in short runs and eager results are the reference."""
    return t.compile is True or (t.compile == "auto" and device.type == "cuda")


def check_device(device: str) -> None:
    """Refuse a device this machine lacks (``train.device=cuda`` without a GPU)."""
    if device in ("auto", "cpu"):
        return
    import torch

    if device.startswith("cuda"):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= n:
            have = f"{n} CUDA device(s)" if n else "no CUDA device"
            raise MheError(f"train.device={device!r} is not available: this machine has {have}; valid here: auto, cpu")
    if device == "mps" and not torch.backends.mps.is_available():
        raise MheError("train.device='mps' is not available on this machine; valid here: auto, cpu")


def option_device(device: str, option: str = "--device") -> torch.device:
    """The device a command's ``--device`` names: ``auto`` (a GPU when there is one), ``cpu``,
    ``cuda`` or ``cuda:N``; anything else, or a GPU this machine lacks, is refused naming ``option``."""
    import torch

    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
        raise MheError(f"{option} {device!r} is not allowed; it takes auto, cpu, cuda or cuda:N")
    try:
        check_device(device)
    except MheError as e:  # the same check as train.device, said of this option
        raise MheError(str(e).replace(f"train.device={device!r}", f"{option} {device}")) from None
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def apply_overrides(cfg: RunConfig, items: list[str], *, device_check: bool = True) -> RunConfig:
    """Apply ``section.key=value`` items (``model.attn_options.n_kv_heads=2`` reaches nested
    options), each parsed by its field's type; unknown keys list the valid ones. A
    ``model.attention`` item applies first, so options given with it belong to the new kind."""
    pairs = []
    for item in items or []:
        if "=" not in item:
            raise MheError(f"--set takes KEY=VALUE, got {item!r}")
        key, raw = item.split("=", 1)
        pairs.append((key.strip(), raw))
    pairs.sort(key=lambda kv: kv[0] != "model.attention")
    for key, raw in pairs:
        section, _, rest = key.partition(".")
        if section not in ("train", "data", "model"):
            raise one_of("--set section", section, ("train", "data", "model"))
        if not rest:
            raise MheError(f"--set takes SECTION.KEY=VALUE, got {key!r}")
        if key == "model.attention":
            cfg.model = cfg.model.replace(attention=parse_text(key, raw, field_types(ModelConfig)["attention"]))
            continue
        set_path(getattr(cfg, section), rest.split("."), raw, key)
        if key == "train.steps":
            cfg.train.epochs = 0.0  # an explicit step count wins over (fine-tuning's default) epochs
    validate(cfg)
    if device_check:
        check_device(cfg.train.device)
    return cfg
