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
