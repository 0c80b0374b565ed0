"""Building blocks shared by mstar's models, written against `mstar.ops` and plain torch.

Parameter names follow the Hugging Face checkpoints so that most weights load by name.
Where we fuse several checkpoint tensors into one matrix (q/k/v, gate/up, ...),
`FusedLinear` records which rows of the fused weight each checkpoint tensor fills; the
weight map (`weight_map`) turns that into {checkpoint name: destination} for the loader.

Every forward takes the flattened tokens of one step ([T, ...], decode rows first, see
context.py) and calls the *_decode op on the first `num_decode_tokens` rows and the
*_prefill op on the rest, skipping a part that is empty.

One idea per file: weights.py (the checkpoint weight map), linear.py, embedding.py, norm.py,
mlp.py, rotary.py, attention.py; every public name is re-exported here.
"""

from mstar.models.layers.weights import ShardInfo, WeightSlot, set_shard, weight_map
from mstar.models.layers.linear import FusedLinear, Linear, ParallelLMHead, ParamHolder, RowParallelLinear
from mstar.models.layers.embedding import Embedding, VocabParallelEmbedding
from mstar.models.layers.norm import RMSNorm
from mstar.models.layers.mlp import GatedMLP
from mstar.models.layers.rotary import RotaryCache, rope_settings
from mstar.models.layers.attention import QKNormAttention, paged_attention

__all__ = ['Embedding', 'FusedLinear', 'GatedMLP', 'Linear', 'ParallelLMHead', 'ParamHolder', 'QKNormAttention', 'RMSNorm', 'RotaryCache', 'RowParallelLinear', 'ShardInfo', 'VocabParallelEmbedding', 'WeightSlot', 'paged_attention', 'rope_settings', 'set_shard', 'weight_map']
