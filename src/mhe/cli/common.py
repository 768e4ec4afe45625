"""Options and words several commands share, so the same situation reads the same everywhere."""

from __future__ import annotations

from mhe.errors import MheError

DATA_DIR_HELP = "data folder (default: $MHE_DATA, else ../shared/data relative to the working directory)"
RUN_HELP = "the run folder (one that holds config.json), or one of its checkpoints/step-N folders"


def add_run_folder_arg(p, help: str = RUN_HELP) -> None:
    """``--run`` (also spelled ``--checkpoint``): a run folder, as ``args.run``."""
    p.add_argument("--run", "--checkpoint", dest="run", required=True, metavar="RUN", help=help)


def refuse_set_keys(items: list[str], owned: dict[str, str]) -> None:
    """Refuse a ``--set`` item of a key an option of this command owns (``owned``: key -> what
    sets it): one of the two would otherwise be dropped without a word."""
    for item in items:
        key = item.split("=", 1)[0].strip()
        if key in owned:
            raise MheError(f"--set {item} clashes with this command's own {key}, set by {owned[key]}; "
                           "drop the item")


STEP_MODE_CHOICES = ("auto", "eager", "graph", "compile")  # mhe.models.captured_step.STEP_MODES (no torch here)
COMPILE_OPTION_KEYS = ("mode", "options", "backend")  # torch.compile's keywords a decode step takes


def add_decode_step_args(p) -> None:
    """``--step-mode`` and ``--compile-options``: how the decode step runs (the session's options of
    ``model.generate`` and beam search, :mod:`mhe.models.captured_step`)."""
    p.add_argument("--step-mode", default="auto", choices=STEP_MODE_CHOICES,
                   help="the decode step: auto (compiled and captured on a GPU, eager on a CPU), eager, graph "
                        "(captured eager kernels), compile (default: auto)")
    p.add_argument("--compile-options", default=None, metavar="JSON",
                   help="torch.compile options of a compiled decode step, as a JSON object with keys among "
                        f"{', '.join(COMPILE_OPTION_KEYS)}, e.g. '{{\"mode\": \"max-autotune-no-cudagraphs\"}}'; "
                        "'{}' turns off the one-row default (coordinate-descent tuning, a slower first call)")


def compile_options(text: str | None) -> dict | None:
    """``--compile-options``'s JSON as a dict (None when not given); one line naming what is wrong."""
    import json

    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise MheError(f"--compile-options must be a JSON object, got {text!r} ({e.msg})") from None
    if not isinstance(value, dict):
        raise MheError(f"--compile-options must be a JSON object like '{{\"mode\": \"default\"}}', got {text!r}")
    unknown = sorted(set(value) - set(COMPILE_OPTION_KEYS))
    if unknown:
        raise MheError(f"--compile-options: unknown key {unknown[0]!r}; allowed: {', '.join(COMPILE_OPTION_KEYS)}")
    if "options" in value and not isinstance(value["options"], dict):
        raise MheError(f"--compile-options: 'options' must be an object of inductor settings, got {value['options']!r}")
    return value
