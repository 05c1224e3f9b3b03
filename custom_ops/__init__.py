"""Our core-attention kernels.

``custom_ops.varlen_attention``: core attention over a fused batch of CA-tasks (Pallas forward,
backward, block tables, reference). Call ``custom_ops.varlen_attention.varlen_attention(...)``;
the package does not re-export that function, because its name would shadow the module.
``custom_ops.blockwise_attention``: the same contract in blockwise jnp (the CPU kernel).
"""

from custom_ops import blockwise_attention
from custom_ops import varlen_attention
from custom_ops.varlen_attention import BlockSizes
from custom_ops.varlen_attention import varlen_attention_reference

__all__ = ["BlockSizes", "blockwise_attention", "varlen_attention", "varlen_attention_reference"]
