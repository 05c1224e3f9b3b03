"""Our core-attention kernels.

``custom_ops.varlen_attention``: the CA-task attention contract every kernel implements (input
checks, the plain-jnp reference ``varlen_attention_reference``) and what the kernels share
(``KERNEL_OUTPUTS_NAME``, ``KernelUnavailableError``, ``fills_of``; the package re-exports them).
``custom_ops.blockwise_attention``: the contract in blockwise jnp (the CPU kernel).
``custom_ops.mosaic_attention``: the contract as Pallas Mosaic GPU kernels (Hopper); the package
does not import it (``from custom_ops import mosaic_attention`` loads Mosaic GPU).
``custom_ops.remote_exchange``: the data plane's exchange as device-initiated copies (Pallas
Mosaic GPU; not imported by the package either).
``custom_ops.side_stream``: the exchange's row copy on a side CUDA stream with an SM budget, hidden
behind independent compute (an XLA FFI pair in ``custom_ops/side_stream/``; not imported by the
package).
``custom_ops.flash3_attention``: the adapter of FlashAttention-3 (``flash-attn3-jax``) to the
contract; it imports the bindings only when a call is traced, so it imports without them.
"""

from custom_ops import blockwise_attention
from custom_ops import varlen_attention
from custom_ops.varlen_attention import (KERNEL_OUTPUTS_NAME, KernelUnavailableError, fills_of,
                                        varlen_attention_reference)

__all__ = ["KERNEL_OUTPUTS_NAME", "KernelUnavailableError", "blockwise_attention", "fills_of",
           "varlen_attention", "varlen_attention_reference"]
