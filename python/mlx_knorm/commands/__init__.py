"""``mlx-knorm generate | chat | cache-prompt | server``: mlx-lm's own commands
with an L2-norm eviction cache.

Each command runs mlx-lm's ``main`` (its argument parsing, generation,
sampling, chat loop and HTTP server) with three things changed for the
duration of the call: its parser gains the cache's flags, every model it
loads builds its caches through ``make_knorm_cache``, and it reports the KV
memory kept next to mlx-lm's own statistics (``session.py``).

mlx-lm is imported only when a command runs, so that ``python -m mlx_knorm
info`` works with MLX alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from ..extras import install_hint

# Command name -> (module under mlx_knorm.commands, the mlx-lm command it extends).
LM_COMMANDS = {
    "generate": ("generate", "mlx_lm.generate"),
    "chat": ("chat", "mlx_lm.chat"),
    "cache-prompt": ("cache_prompt", "mlx_lm.cache_prompt"),
    "server": ("server", "mlx_lm.server"),
}


def command_help(name: str) -> str:
    return f"{LM_COMMANDS[name][1]} with L2-norm KV-cache eviction (every flag of it, plus --budget ...)"


def run(name: str, argv: list[str]) -> int:
    """Run ``mlx-knorm NAME ARGV...``; returns the exit status."""
    if importlib.util.find_spec("mlx_lm") is None:
        print(f"mlx-knorm {name}: error: this command runs mlx-lm's {LM_COMMANDS[name][1]}, and "
              f"mlx-lm is not installed: {install_hint('lm')}", file=sys.stderr)
        return 1
    module = importlib.import_module(f"{__name__}.{LM_COMMANDS[name][0]}")
    return module.main(argv)


__all__ = ["LM_COMMANDS", "command_help", "run"]
