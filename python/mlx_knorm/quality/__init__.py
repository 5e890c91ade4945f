"""Quality check on a trained LM: a byte-level llama trained on the Python
standard library, shipped in ``model/``, and an eviction-policy evaluation
that runs on it or on any mlx-lm model."""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
BUDGET_FRACTIONS = (0.125, 0.25, 0.5)
QUERY_CHUNK = 256  # query rows per attention block in the eval

# The needle task's default grid (needle.py; the command line reads them from here).
HAYSTACKS = ("passkey", "prose")
NEEDLE_CONTEXTS = (1024, 2048, 4096)
NEEDLE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE_BUDGET_FRACTIONS = (0.125, 0.25)
# Keys per cell: with 4, a cell every key of which is found (4/4, 95% Wilson
# interval [0.51, 1]) and one none of which is (0/4, [0, 0.49]) are told apart.
NEEDLE_KEYS = 4
PREFILL_STEP_SIZE = 256  # prompt tokens per model call (mlx-lm's prefill_step_size)
