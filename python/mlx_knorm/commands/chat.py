"""``mlx-knorm chat``: ``mlx_lm.chat``'s ``main`` with eviction caches.

The chat keeps one prompt cache for the conversation (``make_prompt_cache``,
now ``make_knorm_cache``; ``r`` resets it), so a long conversation stays at
``budget`` rows per head. ``ChatUI`` is replaced by a subclass whose
``end_turn`` adds the KV memory line under mlx-lm's per-turn statistics.
"""

from __future__ import annotations

import importlib

from .memory import kv_memory_line
from .session import Session

mlx_lm_chat = importlib.import_module("mlx_lm.chat")

DESCRIPTION = """\
mlx_lm.chat with L2-norm KV-cache eviction: the conversation's cache keeps at
most --budget rows per head in each attention layer, so memory stays fixed
however long the chat grows. After each turn, a line under mlx-lm's statistics
gives the KV bytes the caches hold and have allocated against what a full
cache would hold at that context."""


def main(argv: list[str]) -> int:
    session = Session("chat", mlx_lm_chat, DESCRIPTION)

    class ChatUI(mlx_lm_chat.ChatUI):
        def end_turn(self, response):
            super().end_turn(response)
            if self._rank == 0 and response is not None and session.last_cache is not None:
                # One line however narrow the terminal (it wraps it, not the console).
                self._console.print(f"  [ui.muted]{kv_memory_line(session.last_cache)}[/ui.muted]",
                                    soft_wrap=True)

    return session.run(argv, ChatUI=ChatUI)
