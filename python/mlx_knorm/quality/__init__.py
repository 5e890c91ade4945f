"""Quality check on a trained LM: a byte-level llama trained on the Python
standard library, shipped in ``model/``, and an eviction-policy evaluation
that runs on it or on any mlx-lm model."""

from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parent / "model"
BUDGET_FRACTIONS = (0.125, 0.25, 0.5)
QUERY_CHUNK = 256  # query rows per attention block in the eval

# The needle task's grids (needle.py; the command line reads them from here).
# The default grid is sized for a 2-core CPU: 3 contexts x 5 depths x 2
# budgets, one key per cell, the full cache and three policies
# (NEEDLE_POLICIES), 186k prompt tokens (12 minutes with --jobs 2 on SmolLM2 here,
# docs/quality.md). ``--full-grid`` is the full grid: both haystacks, the
# eval's nine policies, NEEDLE_FULL_KEYS keys per cell, about 3.3M tokens.
HAYSTACKS = ("passkey", "prose")
NEEDLE_HAYSTACKS = ("passkey",)
NEEDLE_CONTEXTS = (1024, 2048, 4096)
NEEDLE_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE_BUDGET_FRACTIONS = (0.125, 0.25)
# One key per cell still tells the policies apart over a row of cells: 0 of
# 15 (95% Wilson interval [0, 0.20]) against 8 of 15 ([0.30, 0.75]).
NEEDLE_KEYS = 1
# With 4, a cell every key of which is found (4/4, [0.51, 1]) and one none
# of which is (0/4, [0, 0.49]) are told apart.
NEEDLE_FULL_KEYS = 4
PREFILL_STEP_SIZE = 256  # prompt tokens per model call (mlx-lm's prefill_step_size)
