"""Import a Hugging Face Llama or Mistral checkpoint (`config.json` + safetensors) into
`model.Transformer`.

    cfg, params = load_hf_checkpoint("/ckpts/Llama-3.1-8B", dtype="bfloat16")
    logits = Transformer(cfg, attention.local_attention).apply(
        params, tokens_BxT, layout, method=Transformer.logits)

    python -m distca_jax.hf_import CHECKPOINT_DIR           # the mapped config, expected #params
    python -m distca_jax.hf_import CHECKPOINT_DIR --check   # also reads and validates every tensor

Mapping (HF `nn.Linear` weights are [out, in]; ours are [in, ...out]):
  model.embed_tokens.weight [V, E]                 -> params/embedding [V, E]
  model.layers.{i}.input_layernorm.weight [E]       -> .../pre_ca/attn_norm/scale [E]
  model.layers.{i}.self_attn.q_proj.weight [H*D, E] -> .../pre_ca/wq [E, H, D]
  model.layers.{i}.self_attn.k_proj.weight [K*D, E] -> .../pre_ca/wk [E, K, D]   (v_proj: wv)
  model.layers.{i}.self_attn.o_proj.weight [E, H*D] -> .../post_ca/wo [H, D, E]
  model.layers.{i}.post_attention_layernorm.weight  -> .../post_ca/mlp_norm/scale [E]
  model.layers.{i}.mlp.gate_proj.weight [F, E]      -> .../post_ca/w_gate [E, F]  (up_proj: w_up)
  model.layers.{i}.mlp.down_proj.weight [E, F]      -> .../post_ca/w_down [F, E]
  model.norm.weight [E]                             -> params/final_norm/scale [E]
  lm_head.weight [V, E]                             -> params/lm_head [E, V] (absent when tied)
where `...` is `layers/layer` with a leading [L] axis (scan_layers) or `layer_{i}/layer`.
No permutation of q/k is needed: HF Llama checkpoints already use the half-split (rotate_half)
RoPE convention that `model.apply_rope` implements.
Mistral's block and tensor names are Llama's; its `sliding_window` w (transformers' default 4096
when absent, null = full attention) makes every layer a sliding-window layer
(`model.layer_pattern='local'`, `model.window=w`: query position p attends keys (p - w, p], as
transformers' sliding-window mask).

Storage dtypes: F32, F16, F64 and BF16 tensors are read and converted to `cfg.param_dtype`
(float32 by default). F32/F16/F64 go through `safetensors.safe_open(framework="numpy")`. BF16 is
read from the raw bytes (the file header gives each tensor's byte range; the 16-bit patterns are
shifted into the high half of float32, which is exact), so it needs neither torch nor a
safetensors/ml_dtypes version that understands bfloat16.

Placement: by default every array is a host numpy array. With `mesh=` (shardings derived from the
model's logical axis names through the rules table; `fsdp=True` as a `mesh.fsdp` run) or `shardings=` (a pytree matching the params),
each parameter is `jax.device_put` with its sharding as soon as it is read, so every device holds
only its shards; host memory peaks at one parameter in float32 (for Llama-3-8B the largest is a
stacked MLP matrix, 32 x 4096 x 14336 x 4 B = 7.5 GB) plus the page cache of the mapped files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import struct
import sys
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from safetensors import safe_open

from distca_jax import attention as attn_lib
from distca_jax import model as model_lib
from distca_jax import sharding as sharding_lib

PathLike = str | os.PathLike
Params = dict[str, Any]

_INDEX_FILE = "model.safetensors.index.json"
# Tensors some older checkpoints carry that the model recomputes: skipped, never an error.
_IGNORED_TENSORS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# Defaults of transformers' LlamaConfig for keys a config.json may leave out.
_HF_DEFAULTS = {"rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
_MISTRAL_SLIDING_WINDOW = 4096  # transformers' MistralConfig default


class HFImportError(ValueError):
  """A checkpoint or config that cannot be imported; the message names the tensor/key and file."""


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------
def _read_config_json(config_json: Mapping[str, Any] | PathLike) -> tuple[dict[str, Any], str]:
  if isinstance(config_json, Mapping):
    return dict(config_json), "<dict>"
  path = os.fspath(config_json)
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  if not os.path.isfile(path):
    raise HFImportError(f"no Hugging Face config at {path!r}; pass a checkpoint directory holding "
                        "config.json, the path of config.json itself, or its parsed dict")
  try:
    with open(path) as f:
      return json.load(f), path
  except json.JSONDecodeError as e:
    raise HFImportError(f"{path!r} is not valid JSON: {e}") from e


def _rope_settings(hf: Mapping[str, Any], src: str) -> dict[str, Any]:
  """RoPE fields of ModelConfig from `rope_parameters` (transformers >= 5) or `rope_scaling`."""
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(rope, Mapping):
    raise HFImportError(f"{src}: rope settings must be a JSON object, got {rope!r}")
  theta = rope.get("rope_theta", hf.get("rope_theta", _HF_DEFAULTS["rope_theta"]))
  out: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling_factor": 0.0}
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    raise HFImportError(f"{src}: partial_rotary_factor={rope['partial_rotary_factor']} is not "
                        "supported; the model rotates the whole head dimension")
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type in (None, "default"):
    return out
  if rope_type != "llama3":
    raise HFImportError(f"{src}: rope_type={rope_type!r} is not supported; only 'default' and "
                        "'llama3' frequency scaling are implemented (model.rope_frequencies)")
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  missing = [k for k in keys if k not in rope]
  if missing:
    raise HFImportError(f"{src}: llama3 rope scaling {dict(rope)} lacks {missing}")
  out.update(rope_scaling_factor=float(rope["factor"]),
             rope_low_freq_factor=float(rope["low_freq_factor"]),
             rope_high_freq_factor=float(rope["high_freq_factor"]),
             rope_original_max_position=int(rope["original_max_position_embeddings"]))
  if out["rope_scaling_factor"] <= 0:
    raise HFImportError(f"{src}: llama3 rope scaling needs factor > 0, got {rope['factor']}")
  if out["rope_high_freq_factor"] <= out["rope_low_freq_factor"]:
    raise HFImportError(f"{src}: llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                        f"{rope['high_freq_factor']} <= {rope['low_freq_factor']}")
  return out


def _layer_settings(hf: Mapping[str, Any], model_type: str, src: str) -> dict[str, Any]:
  """Layer-type fields of ModelConfig: Mistral's `sliding_window` (transformers' default 4096
  when the key is absent; null = full attention) makes every layer a window layer."""
  if model_type != "mistral":
    if hf.get("sliding_window") is not None or hf.get("layer_types"):
      raise HFImportError(f"{src}: sliding_window / layer_types in a {model_type!r} config: "
                          f"transformers' {model_type} model does not read them; remove them")
    return {}
  if hf.get("layer_types"):
    raise HFImportError(f"{src}: per-layer layer_types are not imported (transformers' "
                        "MistralForCausalLM ignores them too); remove the key, or import and "
                        "set model.layer_pattern")
  window = hf.get("sliding_window", _MISTRAL_SLIDING_WINDOW)
  if window is None:
    return {}
  if not isinstance(window, int) or window < 1:
    raise HFImportError(f"{src}: sliding_window={window!r} must be a positive integer or null")
  return {"layer_pattern": "local", "window": int(window)}


def model_config_from_hf(config_json: Mapping[str, Any] | PathLike,
                         **overrides) -> model_lib.ModelConfig:
  """Maps a Hugging Face Llama or Mistral `config.json` onto `ModelConfig`.

  Args:
    config_json: the parsed dict, the path of config.json, or the checkpoint directory.
    **overrides: `ModelConfig` fields set after the mapping (e.g. `dtype="float32"`,
      `scan_layers=False`, `remat="none"`).

  Returns:
    The ModelConfig. Features the model does not implement (biases, other activations, other
    RoPE scalings, quantized weights, non-Llama architectures) raise `HFImportError`.
  """
  hf, src = _read_config_json(config_json)
  model_type = hf.get("model_type", "llama")
  if model_type not in ("llama", "mistral"):
    raise HFImportError(f"{src}: model_type={model_type!r}; only 'llama' and 'mistral' "
                        "checkpoints can be imported (other families differ in biases, norms or "
                        "attention)")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key, False):
      raise HFImportError(f"{src}: {key}=true is not supported; the model has no projection biases")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise HFImportError(f"{src}: hidden_act={act!r} is not supported; the MLP is SwiGLU (silu)")
  if hf.get("quantization_config"):
    raise HFImportError(f"{src}: quantized checkpoints are not supported "
                        f"(quantization_config={hf['quantization_config']!r}); use a bf16/f32 one")
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads")
  missing = [k for k in required if hf.get(k) is None]
  if missing:
    raise HFImportError(f"{src}: config lacks required keys {missing}")
  n_heads = int(hf["num_attention_heads"])
  hidden = int(hf["hidden_size"])
  head_dim = hf.get("head_dim")
  if head_dim is None:
    if hidden % n_heads:
      raise HFImportError(f"{src}: hidden_size={hidden} is not a multiple of "
                          f"num_attention_heads={n_heads} and no head_dim is given")
    head_dim = hidden // n_heads
  n_kv = hf.get("num_key_value_heads")
  fields = dict(
      vocab_size=int(hf["vocab_size"]),
      dim=hidden,
      n_layers=int(hf["num_hidden_layers"]),
      n_heads=n_heads,
      n_kv_heads=n_heads if n_kv is None else int(n_kv),
      head_dim=int(head_dim),
      mlp_dim=int(hf["intermediate_size"]),
      norm_eps=float(hf.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"])),
      tie_embeddings=bool(hf.get("tie_word_embeddings", _HF_DEFAULTS["tie_word_embeddings"])),
      **_rope_settings(hf, src),
      **_layer_settings(hf, model_type, src),
  )
  known = {f.name for f in dataclasses.fields(model_lib.ModelConfig)}
  unknown = sorted(set(overrides) - known)
  if unknown:
    raise HFImportError(f"unknown ModelConfig overrides {unknown}; valid fields: {sorted(known)}")
  fields.update(overrides)
  try:
    return model_lib.ModelConfig(**fields)
  except ValueError as e:
    raise HFImportError(f"{src}: mapped config is invalid: {e}") from e


# ----------------------------------------------------------------------------------------------
# Reading safetensors files
# ----------------------------------------------------------------------------------------------
def _read_header(path: str) -> tuple[dict[str, Any], int]:
  """(header dict, byte offset of the data section) of one safetensors file."""
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise HFImportError(f"{path!r} is not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > os.path.getsize(path) - 8:
      raise HFImportError(f"{path!r} is not a safetensors file (header length {n} exceeds the file)")
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise HFImportError(f"{path!r} is not a safetensors file (bad header: {e})") from e
  header.pop("__metadata__", None)
  return header, 8 + n


class _CheckpointReader:
  """Tensor name -> float32 numpy array, across one file or an index-sharded set of files."""

  def __init__(self, checkpoint_dir: PathLike):
    self.dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(self.dir):
      raise HFImportError(f"checkpoint directory {self.dir!r} does not exist")
    self._headers: dict[str, tuple[dict[str, Any], int]] = {}
    index_path = os.path.join(self.dir, _INDEX_FILE)
    if os.path.isfile(index_path):
      self.file_of = self._from_index(index_path)
    else:
      self.file_of = self._from_glob()

  def _header(self, file: str) -> tuple[dict[str, Any], int]:
    if file not in self._headers:
      self._headers[file] = _read_header(os.path.join(self.dir, file))
    return self._headers[file]

  def _from_index(self, index_path: str) -> dict[str, str]:
    try:
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise HFImportError(f"{index_path!r} is not a safetensors index with a 'weight_map': {e!r}") from e
    for name, file in weight_map.items():
      if not os.path.isfile(os.path.join(self.dir, file)):
        raise HFImportError(f"{index_path!r} maps tensor {name!r} to {file!r}, which is not in "
                            f"{self.dir!r}; the download is incomplete")
      if name not in self._header(file)[0]:
        raise HFImportError(f"{index_path!r} maps tensor {name!r} to {file!r}, but that file does "
                            f"not contain it")
    return dict(weight_map)

  def _from_glob(self) -> dict[str, str]:
    files = sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors"))
    if not files:
      raise HFImportError(f"no *.safetensors files in {self.dir!r}; expected model.safetensors, or "
                          f"sharded files listed by {_INDEX_FILE} (.bin/.pth checkpoints: convert "
                          "them to safetensors first)")
    file_of: dict[str, str] = {}
    for file in files:
      for name in self._header(file)[0]:
        if name in file_of:
          raise HFImportError(f"tensor {name!r} appears in both {file_of[name]!r} and {file!r} in "
                              f"{self.dir!r} and there is no {_INDEX_FILE} to say which is meant")
        file_of[name] = file
    return file_of

  def describe(self) -> str:
    files = sorted(set(self.file_of.values()))
    return f"{self.dir!r} ({', '.join(files)})"

  def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor `name` as float32, checked against the expected HF `shape`."""
    if name not in self.file_of:
      raise HFImportError(f"tensor {name!r} is missing from checkpoint {self.describe()}")
    file = self.file_of[name]
    path = os.path.join(self.dir, file)
    header, data_start = self._header(file)
    info = header[name]
    got = tuple(info["shape"])
    if got != tuple(shape):
      raise HFImportError(f"tensor {name!r} in {path!r} has shape {got}, but the config implies "
                          f"{tuple(shape)}; config.json and the weights disagree (or an override "
                          "changed a dimension)")
    dtype = info["dtype"]
    if dtype == "BF16":
      start, end = info["data_offsets"]
      n = math.prod(got)
      if end - start != 2 * n:
        raise HFImportError(f"tensor {name!r} in {path!r}: byte range {end - start} != 2 * {n}")
      bits = np.fromfile(path, dtype="<u2", count=n, offset=data_start + start)
      # bfloat16 is the high half of a float32: widening is exact.
      return (bits.astype(np.uint32) << 16).view(np.float32).reshape(got)
    if dtype not in ("F32", "F16", "F64"):
      raise HFImportError(f"tensor {name!r} in {path!r} has dtype {dtype}; only F32, F16, BF16 and "
                          "F64 weights can be imported")
    with safe_open(path, framework="numpy") as f:
      return np.asarray(f.get_tensor(name), dtype=np.float32)


# ----------------------------------------------------------------------------------------------
# Name and layout mapping
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Spec:
  path: tuple[str, ...]                         # our path inside a layer (or inside params/)
  hf_name: str                                  # HF name; '{i}' is the layer index
  hf_shape: Callable[[model_lib.ModelConfig], tuple[int, ...]]
  convert: Callable[[np.ndarray, model_lib.ModelConfig], np.ndarray]  # HF layout -> ours
  invert: Callable[[np.ndarray, model_lib.ModelConfig], np.ndarray]   # ours -> HF (hf_export)


def _ident(w, c):
  del c
  return w


def _transpose(w, c):
  del c
  return w.T


def _heads_in(heads: Callable[[model_lib.ModelConfig], int]):
  """[heads*D, E] -> [E, heads, D]."""
  return lambda w, c: w.T.reshape(c.dim, heads(c), c.head_dim)


def _heads_out(w, c):
  """[E, heads, D] -> [heads*D, E] (the inverse of `_heads_in`)."""
  return w.reshape(c.dim, -1).T


LAYER_SPECS = (
    Spec(("pre_ca", "attn_norm", "scale"), "model.layers.{i}.input_layernorm.weight",
          lambda c: (c.dim,), _ident, _ident),
    Spec(("pre_ca", "wq"), "model.layers.{i}.self_attn.q_proj.weight",
          lambda c: (c.n_heads * c.head_dim, c.dim), _heads_in(lambda c: c.n_heads), _heads_out),
    Spec(("pre_ca", "wk"), "model.layers.{i}.self_attn.k_proj.weight",
          lambda c: (c.n_kv_heads * c.head_dim, c.dim), _heads_in(lambda c: c.n_kv_heads),
          _heads_out),
    Spec(("pre_ca", "wv"), "model.layers.{i}.self_attn.v_proj.weight",
          lambda c: (c.n_kv_heads * c.head_dim, c.dim), _heads_in(lambda c: c.n_kv_heads),
          _heads_out),
    Spec(("post_ca", "wo"), "model.layers.{i}.self_attn.o_proj.weight",
          lambda c: (c.dim, c.n_heads * c.head_dim),
          lambda w, c: w.T.reshape(c.n_heads, c.head_dim, c.dim),
          lambda w, c: w.reshape(c.n_heads * c.head_dim, c.dim).T),
    Spec(("post_ca", "mlp_norm", "scale"), "model.layers.{i}.post_attention_layernorm.weight",
          lambda c: (c.dim,), _ident, _ident),
    Spec(("post_ca", "w_gate"), "model.layers.{i}.mlp.gate_proj.weight",
          lambda c: (c.mlp_dim, c.dim), _transpose, _transpose),
    Spec(("post_ca", "w_up"), "model.layers.{i}.mlp.up_proj.weight",
          lambda c: (c.mlp_dim, c.dim), _transpose, _transpose),
    Spec(("post_ca", "w_down"), "model.layers.{i}.mlp.down_proj.weight",
          lambda c: (c.dim, c.mlp_dim), _transpose, _transpose),
)
EMBED = Spec(("embedding",), "model.embed_tokens.weight", lambda c: (c.vocab_size, c.dim),
               _ident, _ident)
FINAL_NORM = Spec(("final_norm", "scale"), "model.norm.weight", lambda c: (c.dim,), _ident,
                    _ident)
LM_HEAD = Spec(("lm_head",), "lm_head.weight", lambda c: (c.vocab_size, c.dim), _transpose,
                 _transpose)


def _expected_hf_names(cfg: model_lib.ModelConfig) -> set[str]:
  names = {EMBED.hf_name, FINAL_NORM.hf_name}
  if not cfg.tie_embeddings:
    names.add(LM_HEAD.hf_name)
  for i in range(cfg.n_layers):
    names.update(s.hf_name.format(i=i) for s in LAYER_SPECS)
  return names


def _check_names(reader: _CheckpointReader, cfg: model_lib.ModelConfig) -> None:
  """Fails fast, before reading any data, on missing or unexpected tensors."""
  expected = _expected_hf_names(cfg)
  present = set(reader.file_of)
  missing = sorted(expected - present)
  if missing:
    hint = ""
    if missing == [LM_HEAD.hf_name]:
      hint = " (the config says tie_word_embeddings=false; is the config right?)"
    raise HFImportError(f"tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                        f"({len(missing)} in all) missing from checkpoint {reader.describe()}{hint}")
  unexpected = sorted(n for n in present - expected
                      if not _IGNORED_TENSORS.fullmatch(n)
                      and not (cfg.tie_embeddings and n == LM_HEAD.hf_name))
  if unexpected:
    raise HFImportError(
        f"checkpoint {reader.describe()} holds tensors the model has no place for: "
        f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all); "
        f"the config (n_layers={cfg.n_layers}, tie_embeddings={cfg.tie_embeddings}) does not match "
        "the weights, or the checkpoint has features (e.g. biases) this model lacks")


def _iter_params(reader: _CheckpointReader, cfg: model_lib.ModelConfig,
                 scan_layers: bool) -> Iterator[tuple[tuple[str, ...], np.ndarray]]:
  """Yields (path under 'params', array in our layout and cfg.param_dtype), one at a time."""
  dtype = jnp.dtype(cfg.param_dtype)  # a numpy dtype (ml_dtypes' for bfloat16)

  def cast(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=dtype)

  def read(spec: Spec, i: int | None = None) -> np.ndarray:
    name = spec.hf_name.format(i=i) if i is not None else spec.hf_name
    return spec.convert(reader.get(name, spec.hf_shape(cfg)), cfg)

  yield EMBED.path, cast(read(EMBED))
  if cfg.tie_embeddings and LM_HEAD.hf_name in reader.file_of:
    # A tied model's checkpoint may still store the head; it must be the embedding.
    head = reader.get(LM_HEAD.hf_name, LM_HEAD.hf_shape(cfg))
    if not np.array_equal(head, reader.get(EMBED.hf_name, EMBED.hf_shape(cfg))):
      raise HFImportError(f"config says tie_word_embeddings=true but {LM_HEAD.hf_name!r} in "
                          f"{reader.file_of[LM_HEAD.hf_name]!r} differs from "
                          f"{EMBED.hf_name!r}; set tie_word_embeddings=false in config.json "
                          "(or the override tie_embeddings=False)")
  for spec in LAYER_SPECS:
    if scan_layers:
      yield ("layers", "layer") + spec.path, cast(np.stack([read(spec, i)
                                                            for i in range(cfg.n_layers)]))
    else:
      for i in range(cfg.n_layers):
        yield (f"layer_{i}", "layer") + spec.path, cast(read(spec, i))
  yield FINAL_NORM.path, cast(read(FINAL_NORM))
  if not cfg.tie_embeddings:
    yield LM_HEAD.path, cast(read(LM_HEAD))


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def get_path(tree: Mapping[str, Any], path: tuple[str, ...], what: str) -> Any:
  node = tree
  for key in path:
    if not isinstance(node, Mapping) or key not in node:
      raise HFImportError(f"{what} has no entry at {'/'.join(path)!r} (stopped at {key!r}); it "
                          "must have the structure of the params tree ({'params': {...}})")
    node = node[key]
  return node


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def param_shardings(cfg: model_lib.ModelConfig, mesh, fsdp: bool = False) -> Params:
  """{'params': NamedSharding tree} from the model's logical axis names and the rules table
  (`sharding.rules(fsdp)`: with `fsdp`, as a `mesh.fsdp` run places them)."""
  model = model_lib.Transformer(cfg, attn_lib.local_attention)
  ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  abstract = jax.eval_shape(model.init, jax.random.key(0), ids, attn_lib.Layout(ids, ids))
  return sharding_lib.tree_shardings(mesh, nn.get_partition_spec(abstract), fsdp)


def load_hf_params(checkpoint_dir: PathLike, cfg: model_lib.ModelConfig, *,
                   scan_layers: bool | None = None, mesh=None, shardings: Params | None = None,
                   fsdp: bool = False) -> Params:
  """Reads HF Llama safetensors into our params tree `{'params': {...}}`.

  Args:
    checkpoint_dir: directory with *.safetensors (one file, or shards + model.safetensors.index.json).
    cfg: the model config (usually `model_config_from_hf` of the same directory); every tensor's
      shape is checked against it.
    scan_layers: stack layers on a leading [L] axis (`params/layers/layer/...`) or not
      (`params/layer_{i}/layer/...`); defaults to `cfg.scan_layers`.
    mesh: place each parameter on this mesh, sharded by the model's logical axes (the rules
      table, `sharding.rules(fsdp)`).
    shardings: instead of `mesh`, a pytree of `jax.sharding.Sharding` with the params' structure.
    fsdp: with `mesh`, place the parameters as a `mesh.fsdp` run does (over `data` too).

  Returns:
    The params tree: numpy arrays of `cfg.param_dtype` (float32 by default), or `jax.Array`s placed
    by `mesh`/`shardings`, one parameter at a time (see the module docstring for memory).
  """
  if mesh is not None and shardings is not None:
    raise HFImportError("pass either mesh= or shardings=, not both")
  scan_layers = cfg.scan_layers if scan_layers is None else scan_layers
  if mesh is not None:
    shardings = param_shardings(dataclasses.replace(cfg, scan_layers=scan_layers), mesh, fsdp)
  reader = _CheckpointReader(checkpoint_dir)
  _check_names(reader, cfg)
  params: dict[str, Any] = {}
  for path, array in _iter_params(reader, cfg, scan_layers):
    if shardings is not None:
      sharding = get_path(shardings, ("params",) + path, "shardings")
      array = jax.device_put(array, sharding)
    _set(params, path, array)
  return {"params": params}


def load_hf_checkpoint(checkpoint_dir: PathLike, *, mesh=None, shardings: Params | None = None,
                       fsdp: bool = False, **cfg_overrides) -> tuple[model_lib.ModelConfig, Params]:
  """(ModelConfig, params) from a HF Llama checkpoint directory; overrides as in
  `model_config_from_hf` (e.g. `dtype="float32"`), placement as in `load_hf_params`."""
  cfg = model_config_from_hf(checkpoint_dir, **cfg_overrides)
  return cfg, load_hf_params(checkpoint_dir, cfg, mesh=mesh, shardings=shardings, fsdp=fsdp)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m distca_jax.hf_import",
      description="Show how a Hugging Face Llama checkpoint maps onto distca_jax's ModelConfig.")
  parser.add_argument("checkpoint_dir")
  parser.add_argument("--check", action="store_true",
                      help="read every tensor, check names and shapes, count the parameters")
  args = parser.parse_args(argv)
  try:
    cfg = model_config_from_hf(args.checkpoint_dir)
    print(f"config ({os.path.join(args.checkpoint_dir, 'config.json')} -> ModelConfig):")
    for f in dataclasses.fields(cfg):
      print(f"  {f.name} = {getattr(cfg, f.name)!r}")
    print(f"expected parameters: {cfg.num_params():,} "
          f"({cfg.num_params(embeddings=False):,} without embeddings)")
    if args.check:
      reader = _CheckpointReader(args.checkpoint_dir)
      _check_names(reader, cfg)
      count = 0
      # Unstacked, one tensor at a time: a --check of an 8B checkpoint holds one matrix, not 32 GB.
      for _, array in _iter_params(reader, cfg, scan_layers=False):
        count += array.size
      if count != cfg.num_params():
        raise HFImportError(f"read {count:,} parameters but the config implies {cfg.num_params():,}")
      print(f"checked {len(_expected_hf_names(cfg))} tensors in {reader.describe()}: "
            f"parameters: {count:,} OK")
  except HFImportError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
