"""Export `model.Transformer` parameters as a Hugging Face Llama checkpoint (`config.json` +
safetensors) that transformers' `LlamaForCausalLM.from_pretrained` loads.

    export_hf(params, cfg, "/ckpts/mine")                       # params: {'params': {...}} or {...}
    python -m distca_jax.hf_export --workdir RUN --out DIR      # a run's newest verified checkpoint
    python -m distca_jax.hf_export --workdir RUN --out DIR --step 200 --dtype bfloat16

The tensor mapping is `hf_import`'s, inverted tensor by tensor (`hf_import.Spec.invert`), so
`hf_import.load_hf_checkpoint` of an export returns the exported parameters bit for bit (at the
same storage dtype). `config.json` is the inverse of `hf_import.model_config_from_hf`: Llama-3
RoPE scaling is written as `rope_scaling` with `rope_type: llama3` and a top-level `rope_theta`,
as on the Hub. Tensors are written in `dtype` ('float32', 'bfloat16' or 'float16'), in files of
at most `max_shard_bytes` (several: `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json`); host memory holds one file's tensors at a time.

`--workdir` restores the run's checkpoint with the run's own config (`WORKDIR/config.json`) and
mesh, so it runs where the run's devices are (the whole train state is restored: parameters and
Adam moments) and in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterator, Mapping

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from distca_jax import hf_import
from distca_jax import layer_types as types_lib
from distca_jax import model as model_lib
from distca_jax.errors import UserError

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
MAX_SHARD_BYTES = 5 << 30


def hf_config(cfg: model_lib.ModelConfig, dtype: str = "float32",
              max_position_embeddings: int = 0) -> dict[str, Any]:
  """The `config.json` of a LlamaForCausalLM with ``cfg``'s architecture (a MistralForCausalLM
  with `sliding_window` when every layer is a window layer; other layer types raise).
  ``max_position_embeddings`` 0: the RoPE's original context times its scaling factor (or the
  original context without scaling)."""
  types = set(cfg.layer_types)
  window = next(iter(types)).window if len(types) == 1 else 0
  if types != {types_lib.FULL_TYPE} and not window:
    raise UserError(f"model.layer_pattern={cfg.layer_pattern!r} (window={cfg.window}, "
                    f"chunk={cfg.chunk}): only all-full (Llama) or all-window (Mistral) models "
                    "export to Hugging Face")
  family = ("MistralForCausalLM", "mistral") if window else ("LlamaForCausalLM", "llama")
  out = {
      "architectures": [family[0]], "model_type": family[1], "hidden_act": "silu",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "rope_theta": cfg.rope_theta, "attention_bias": False, "mlp_bias": False,
      "torch_dtype": dtype,
      "max_position_embeddings": int(max_position_embeddings or cfg.rope_original_max_position
                                     * (cfg.rope_scaling_factor or 1)),
  }
  if window:
    out["sliding_window"] = window
  if cfg.rope_scaling_factor:
    out["rope_scaling"] = {
        "rope_type": "llama3", "factor": cfg.rope_scaling_factor,
        "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_max_position}
  return out


def _inner(params: Mapping[str, Any]) -> Mapping[str, Any]:
  return params["params"] if set(params) == {"params"} else params


def hf_tensors(params: Mapping[str, Any],
               cfg: model_lib.ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, float32 host array in HF layout), one tensor at a time, in checkpoint order.
  ``params``: the params tree with stacked (``layers/layer``) or per-layer (``layer_{i}``)
  layers, host or device arrays (gathered to the host one at a time). A tensor whose shape is
  not the one ``cfg`` implies raises `UserError`."""
  p = _inner(params)
  scanned = "layers" in p
  specs = hf_import.LAYER_SPECS  # pylint: disable=protected-access
  embed, final, head = (hf_import.EMBED, hf_import.FINAL_NORM,  # pylint: disable=protected-access
                        hf_import.LM_HEAD)  # pylint: disable=protected-access

  def out(spec, path, i=None, index=None):
    w = np.asarray(jax.device_get(hf_import.get_path(p, path, "params")), np.float32)  # pylint: disable=protected-access
    if index is not None:
      w = w[index]
    w = np.ascontiguousarray(spec.invert(w, cfg))
    name = spec.hf_name.format(i=i)
    if tuple(w.shape) != tuple(spec.hf_shape(cfg)):
      raise UserError(f"the parameter for {name} has shape {tuple(w.shape)} in HF layout, but the "
                      f"model config implies {tuple(spec.hf_shape(cfg))}; export with the config "
                      "the parameters belong to")
    return name, w

  yield out(embed, embed.path)
  for i in range(cfg.n_layers):
    for spec in specs:
      if scanned:
        yield out(spec, ("layers", "layer") + spec.path, i, index=i)
      else:
        yield out(spec, (f"layer_{i}", "layer") + spec.path, i)
  yield out(final, final.path)
  if not cfg.tie_embeddings:
    yield out(head, head.path)


def export_hf(params: Mapping[str, Any], cfg: model_lib.ModelConfig, out_dir: str, *,
              dtype: str = "float32", max_shard_bytes: int = MAX_SHARD_BYTES,
              max_position_embeddings: int = 0) -> list[str]:
  """Writes ``cfg`` and ``params`` to ``out_dir`` as a HF Llama checkpoint; returns the
  safetensors file names (one file, or several with `model.safetensors.index.json`)."""
  if dtype not in DTYPES:
    raise UserError(f"--dtype={dtype!r}: choose one of {sorted(DTYPES)}")
  os.makedirs(out_dir, exist_ok=True)
  meta = {"format": "pt"}  # transformers refuses safetensors files without it
  parts: list[list[str]] = []  # the tensor names of each file written, in order
  tmp = lambda k: os.path.join(out_dir, f".part{k}.safetensors")

  def write(group):
    save_file(group, tmp(len(parts)), metadata=meta)
    parts.append(list(group))

  group, size = {}, 0
  for name, w in hf_tensors(params, cfg):
    w = w.astype(DTYPES[dtype])
    if group and size + w.nbytes > max_shard_bytes:
      write(group)
      group, size = {}, 0
    group[name], size = w, size + w.nbytes
  write(group)
  total = len(parts)
  names = (["model.safetensors"] if total == 1
           else [f"model-{k + 1:05d}-of-{total:05d}.safetensors" for k in range(total)])
  for k, name in enumerate(names):
    os.replace(tmp(k), os.path.join(out_dir, name))
  index_path = os.path.join(out_dir, "model.safetensors.index.json")
  if total > 1:
    weight_map = {t: name for name, keys in zip(names, parts) for t in keys}
    total_size = sum(os.path.getsize(os.path.join(out_dir, n)) for n in names)
    with open(index_path, "w") as f:
      json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)
  elif os.path.exists(index_path):
    os.remove(index_path)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config(cfg, dtype, max_position_embeddings), f, indent=2)
  return names


def export_run(workdir: str, out_dir: str, *, step: int | None = None, dtype: str = "float32",
               max_shard_bytes: int = MAX_SHARD_BYTES) -> tuple[int, list[str]]:
  """Exports checkpoint ``step`` (default: the newest that verifies) of the run in ``workdir``
  (its `config.json` names the model and mesh); returns (step, file names)."""
  import ml_collections
  from distca_jax import checkpoint as ckpt_lib
  from distca_jax import config as config_lib
  from distca_jax import trainer
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise UserError(f"--workdir={workdir} holds no config.json: pass the workdir of a training run "
                    "(python -m distca_jax.train writes it there)")
  with open(path) as f:
    c = ml_collections.ConfigDict(json.load(f))
  if jax.process_count() > 1:
    raise UserError("export runs in one process; run it on one host of the job's devices")
  # The state's layout does not depend on the attention backend: restore under 'local' (no
  # kernel to load, no plan caps to sample).
  c.attention.backend, c.attention.kernel = "local", "auto"
  run = trainer.setup_run(c)
  manager = ckpt_lib.CheckpointManager(workdir, c)
  try:
    if step is None:
      state = manager.restore_verified(run.abstract_state)
      if state is None:
        raise UserError(f"--workdir={workdir} holds no checkpoint to export")
      step = int(state.step)
    else:
      if step not in manager.all_steps():
        raise UserError(f"--step={step}: no such checkpoint in {manager.directory} (steps: "
                        f"{manager.all_steps()})")
      state = manager.restore(run.abstract_state, step)
  finally:
    manager.close()
  cfg = config_lib.model_config(c)
  return step, export_hf(state.params, cfg, out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m distca_jax.hf_export",
      description="Write a training run's checkpoint as a Hugging Face Llama checkpoint "
                  "(config.json + safetensors) that transformers loads.")
  parser.add_argument("--workdir", required=True, help="the training run's --workdir")
  parser.add_argument("--out", required=True, help="directory to write the HF checkpoint to")
  parser.add_argument("--step", type=int, default=None,
                      help="checkpoint step (default: the newest that verifies)")
  parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                      help="storage dtype of the tensors")
  args = parser.parse_args(argv)
  try:
    step, names = export_run(args.workdir, args.out, step=args.step, dtype=args.dtype)
  except UserError as e:
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  print(f"exported checkpoint step {step} of {args.workdir} to {args.out}: config.json + "
        f"{', '.join(names)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
