"""Our Pallas kernels.

``custom_ops.varlen_attention``: core attention over a fused batch of CA-tasks (forward,
backward, block tables, reference). Call ``custom_ops.varlen_attention.varlen_attention(...)``;
the package does not re-export that function, because its name would shadow the module.
"""

from custom_ops import varlen_attention
from custom_ops.varlen_attention import BlockSizes
from custom_ops.varlen_attention import varlen_attention_reference

__all__ = ["BlockSizes", "varlen_attention", "varlen_attention_reference"]
