"""How a tool with subcommands runs one: ``TOOL SUBCOMMAND ARGS``. Kept apart from
:mod:`toolbox` because importing this module leaves the import path as it is: ``decode.py rows``
and ``decode.py beam`` measure the tree on ``PYTHONPATH`` (an older one), not this checkout's."""

from __future__ import annotations

import sys


def run_subcommand(tool: str, summary: str, subcommands: dict[str, tuple[str, str]],
                   argv: list[str] | None = None) -> int:
    """Run ``TOOL SUBCOMMAND ARGS...``: import the subcommand's module (``subcommands`` maps each
    name to ``(module, what it measures)``) and return its ``main(ARGS)``. The module is imported
    only when its subcommand runs, so that ``TOOL --help`` (which lists the subcommands) loads no
    torch. An unknown subcommand is refused in one line, exit status 2."""
    import importlib

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, subcommands))
        print(f"usage: {tool} SUBCOMMAND [ARGS ...]   ({tool} SUBCOMMAND --help: its arguments)\n\n{summary}\n\n"
              "subcommands:\n" + "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in subcommands.items()))
        return 0
    if argv[0] not in subcommands:
        print(f"{tool}: unknown subcommand {argv[0]!r}; valid: {', '.join(subcommands)}", file=sys.stderr)
        return 2
    return importlib.import_module(subcommands[argv[0]][0]).main(argv[1:]) or 0
