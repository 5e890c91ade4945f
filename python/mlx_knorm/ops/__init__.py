"""The public ops, one module each: the op, the checks it needs, the
dispatch to the native kernel, the Metal emulator or the pure-MLX fallback,
and the fallback itself."""

from .evict_and_fill import evict_and_fill
from .key_norms import key_norms
from .protected_topk_gather import protected_topk_gather
from .row_scores import row_scores

__all__ = ["evict_and_fill", "key_norms", "protected_topk_gather", "row_scores"]
