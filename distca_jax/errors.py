"""The base class of errors the user can fix, and the entry point's rule for showing them.

A `UserError` is bad input (a config value, a data file, the mesh, a flag, a checkpoint that does
not verify, a run that diverged): its message is one line naming the bad value and the fix, and
`python -m distca_jax.train` prints just that line (no traceback unless `--verbose`) and exits
with status 2. Every other exception is an internal error and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
  """Bad input; the message names the value and the fix (a ValueError, so callers that catch
  ValueError keep working)."""
