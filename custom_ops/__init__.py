"""Our core-attention kernels.

``custom_ops.varlen_attention``: the CA-task attention contract every kernel implements (input
checks, the plain-jnp reference ``varlen_attention_reference``).
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

import jax
import jax.numpy as jnp

# ``checkpoint_name`` of a kernel's forward outputs that its backward takes (O, LSE): remat
# policies that keep attention save values of this name instead of rerunning the kernel
# (``distca_jax.ops.saves_kernel_outputs``).
KERNEL_OUTPUTS_NAME = "ca_kernel_out"


class KernelUnavailableError(RuntimeError):
  """The requested attention kernel cannot run here; the message says how to get it."""


def fills_of(x, *values):
  """Scalars ``values`` in ``x``'s dtype computed from ``x`` (its first element's bits, masked
  to zero, plus the value).

  A ``jnp.where`` filling with a constant scalar broadcasts it to the full shape; under a scan
  whose body is differentiated, JAX computes that broadcast, a loop invariant, once before the
  loop and holds it at full size while the loop runs (an input of the loop). A fill computed
  from ``x`` stays inside the loop, where XLA folds it back to a constant and fuses its
  broadcast into the select."""
  word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(jnp.dtype(x.dtype).itemsize)
  if word is None or x.size == 0 or x.dtype == jnp.bool_:
    return [jnp.asarray(v, x.dtype) for v in values]
  bits = jax.lax.bitcast_convert_type(x.reshape(-1)[0], word) & word(0)
  zero = jax.lax.bitcast_convert_type(bits, x.dtype)
  return [zero + jnp.asarray(v, x.dtype) for v in values]


from custom_ops import blockwise_attention  # noqa: E402  (after the names the kernels import)
from custom_ops import varlen_attention
from custom_ops.varlen_attention import varlen_attention_reference

__all__ = ["KERNEL_OUTPUTS_NAME", "KernelUnavailableError", "blockwise_attention", "fills_of",
           "varlen_attention", "varlen_attention_reference"]
