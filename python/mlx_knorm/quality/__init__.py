"""Quality check on a trained LM: a byte-level llama trained on the Python
standard library, shipped in ``model/``, and an eviction-policy evaluation
that runs on it or on any mlx-lm model."""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
BUDGET_FRACTIONS = (0.25, 0.5, 0.75)
QUERY_CHUNK = 256  # query rows per attention block in the eval
