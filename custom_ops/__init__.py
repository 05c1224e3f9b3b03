"""Our core-attention kernels.

``custom_ops.varlen_attention``: core attention over a fused batch of CA-tasks (Pallas forward,
backward, block tables, reference). Call ``custom_ops.varlen_attention.varlen_attention(...)``;
the package does not re-export that function, because its name would shadow the module.
``custom_ops.blockwise_attention``: the same contract in blockwise jnp (the CPU kernel).
"""

# ``checkpoint_name`` of a kernel's forward outputs that its backward takes (O, LSE), for kernels
# whose forward is not a ``pallas_call`` (FA3's FFI call, the Mosaic GPU kernels): remat policies
# that keep attention save values of this name instead of rerunning the kernel
# (``distca_jax.ops.saves_kernel_outputs``).
KERNEL_OUTPUTS_NAME = "ca_kernel_out"

from custom_ops import blockwise_attention  # noqa: E402  (after the constant the kernels import)
from custom_ops import varlen_attention
from custom_ops.varlen_attention import BlockSizes
from custom_ops.varlen_attention import varlen_attention_reference

__all__ = ["KERNEL_OUTPUTS_NAME", "BlockSizes", "blockwise_attention", "varlen_attention", "varlen_attention_reference"]
