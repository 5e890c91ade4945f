"""Quality check on a trained LM: a byte-level llama trained on the Python
standard library, shipped in ``model/``, and an eviction-policy evaluation."""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
