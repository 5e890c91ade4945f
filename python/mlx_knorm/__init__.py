"""mlx-knorm: L2-norm KV-cache eviction for MLX with native kernels.

Keeps the lowest-norm keys (Devoto et al., EMNLP 2024) with one protected
top-k per incoming block. The state API mirrors
``veloxquant_mlx.quantizers.knorm`` name for name.
"""

from .backend import backend_info, current_backend, native_available, use_backend
from .state import (
    KnormState,
    full_knorm_fp16_bytes,
    init_knorm_state,
    knorm_fp16_bytes,
    knorm_get_kv,
    knorm_update,
    knorm_update_batched,
)
from .ops import evict_and_fill, key_norms, protected_topk_gather, row_scores

__version__ = "0.1.0"

__all__ = [
    "KnormState",
    "backend_info",
    "current_backend",
    "evict_and_fill",
    "full_knorm_fp16_bytes",
    "init_knorm_state",
    "key_norms",
    "knorm_fp16_bytes",
    "knorm_get_kv",
    "knorm_update",
    "knorm_update_batched",
    "native_available",
    "protected_topk_gather",
    "row_scores",
    "use_backend",
]
