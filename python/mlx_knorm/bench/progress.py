"""Progress of a suite on stderr: tqdm when installed, else one line per step."""

from __future__ import annotations

import sys


class Progress:
    """``total`` steps of a suite; silent unless ``enabled``."""

    def __init__(self, total: int, enabled: bool):
        self._bar = None
        self._enabled = enabled
        self._done = 0
        self._total = total
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, unit="timing", file=sys.stderr, leave=False)

    def step(self, description: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.set_description(description)
            self._bar.update()
        elif self._enabled:
            print(f"[{self._done}/{self._total}] {description}", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
