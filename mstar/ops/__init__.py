"""mstar's custom-op layer. Import ops from here: `from mstar import ops; ops.rms_norm(...)`.

Every op is an `OpEntry` (callable): a `torch.ops.mstar.<name>` custom op with a plain-torch
reference and any faster backends registered for it. See registry.py. Each op module
lists its public ops in `__all__`.
"""

from mstar.ops.registry import (all_ops, format_table, get, register_backend, reset_verify_report,  # noqa: F401
                                validate_selection, verify_report)
from mstar.ops.norm import *  # noqa: F401,F403
from mstar.ops.activation import *  # noqa: F401,F403
from mstar.ops.rotary import *  # noqa: F401,F403
from mstar.ops.attention import *  # noqa: F401,F403
from mstar.ops.conv1d import *  # noqa: F401,F403
from mstar.ops.gdn import *  # noqa: F401,F403
from mstar.ops.sampling import *  # noqa: F401,F403
from mstar.ops.dense_attention import *  # noqa: F401,F403
from mstar.ops.layer_norm import *  # noqa: F401,F403
from mstar.ops.snake import *  # noqa: F401,F403
from mstar.ops.snake_beta import *  # noqa: F401,F403
from mstar.ops.adain import *  # noqa: F401,F403
from mstar.ops.modulate import *  # noqa: F401,F403
from mstar.ops.rms_norm_rotary import *  # noqa: F401,F403
from mstar.ops.fp8 import *  # noqa: F401,F403
from mstar.ops.fused_linear import *  # noqa: F401,F403

# Toolchain caches (Triton, Inductor, FlashInfer) under the kernel-cache root, before any backend imports them.
from mstar.ops.cache import toolchains as _toolchains  # noqa: E402

_toolchains.configure()

# Faster backends register themselves where they can run (CUDA + their package); no-op on CPU.
from mstar.ops import backends as _backends  # noqa: E402

_backends.load()
