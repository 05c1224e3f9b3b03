"""HF Llama import: our logits equal transformers' LlamaForCausalLM on checkpoints written to disk.

Tiny random Llama checkpoints (MHA, GQA, MQA; tied and untied; with and without Llama-3 RoPE
scaling; float32 and bf16 storage; one file and index-sharded) are written here with
`safetensors.numpy`, no torch. They load through `distca_jax.hf_import`; the reference logits come
from transformers in a separate torch environment (`tests/hf_reference.py`, run once for all
checkpoints under DISTCA_HF_PYTHON, default <repo>/.venv-hf/bin/python; create it with
`bash scripts/setup_hf_reference.sh`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn
from safetensors.numpy import save_file

from distca_jax import attention as attn_lib
from distca_jax import hf_export, hf_import
from distca_jax import model as model_lib
from distca_jax import sharding as sharding_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
HF_PYTHON = os.environ.get("DISTCA_HF_PYTHON", str(REPO / ".venv-hf" / "bin" / "python"))
T = 32          # tokens per row
DOCS = (9, 14, 4)  # the packed row's documents; the remaining 5 tokens are padding
# float32 tolerance, relative to the largest |logit| of the compared block: observed
# max |ours - transformers| / max |logit| is 3e-7 to 6e-7 (e.g. 1.4e-5 on logits up to 44).
RTOL = 1e-5

_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           # a short original context so the scaling changes frequencies visible within T tokens
           "original_max_position_embeddings": 32}

# name -> (config.json contents, storage dtype, number of safetensors shards)
CASES = {
    "mha_untied": (dict(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False), "float32", 1),
    # transformers >= 5 style: rope_theta inside rope_parameters.
    "gqa_tied_llama3": (dict(
        vocab_size=101, hidden_size=48, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=dict(_LLAMA3, rope_theta=10000.0)), "float32", 1),
    # transformers 4 style (as on the Hub): rope_scaling + top-level rope_theta; MQA; head_dim
    # != hidden / heads; bf16 storage; three shards with model.safetensors.index.json.
    "mqa_headdim_llama3_bf16_sharded": (dict(
        vocab_size=64, hidden_size=40, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, rope_theta=50000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_scaling=dict(_LLAMA3)), "bfloat16", 3),
}


# ----------------------------------------------------------------------------------------------
# Writing HF checkpoints without torch
# ----------------------------------------------------------------------------------------------
def full_hf_config(hf: dict) -> dict:
  return dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
               "max_position_embeddings": 256, "attention_bias": False, "mlp_bias": False}, **hf)


def random_hf_weights(hf: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
  """HF-named float32 weights at scales that give O(1) activations and non-trivial attention."""
  v, e, f = hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"]
  h = hf["num_attention_heads"]
  k = hf.get("num_key_value_heads", h)
  d = hf.get("head_dim") or e // h
  lin = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
  norm = lambda: (1.0 + 0.2 * rng.standard_normal(e)).astype(np.float32)
  w = {"model.embed_tokens.weight": rng.standard_normal((v, e)).astype(np.float32),
       "model.norm.weight": norm()}
  for i in range(hf["num_hidden_layers"]):
    p = f"model.layers.{i}."
    w[p + "input_layernorm.weight"] = norm()
    w[p + "self_attn.q_proj.weight"] = lin(h * d, e)
    w[p + "self_attn.k_proj.weight"] = lin(k * d, e)
    w[p + "self_attn.v_proj.weight"] = lin(k * d, e)
    w[p + "self_attn.o_proj.weight"] = lin(e, h * d)
    w[p + "post_attention_layernorm.weight"] = norm()
    w[p + "mlp.gate_proj.weight"] = lin(f, e)
    w[p + "mlp.up_proj.weight"] = lin(f, e)
    w[p + "mlp.down_proj.weight"] = lin(e, f)
  if not hf.get("tie_word_embeddings", False):
    w["lm_head.weight"] = lin(v, e)
  return w


def write_checkpoint(path: pathlib.Path, hf: dict, weights: dict[str, np.ndarray], *,
                     dtype: str = "float32", shards: int = 1) -> pathlib.Path:
  """config.json + model.safetensors, or `shards` files + model.safetensors.index.json."""
  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(full_hf_config(hf), indent=2))
  np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
  weights = {n: np.ascontiguousarray(a.astype(np_dtype)) for n, a in weights.items()}
  meta = {"format": "pt"}  # transformers refuses safetensors files without it
  if shards == 1:
    save_file(weights, str(path / "model.safetensors"), metadata=meta)
    return path
  names = sorted(weights)
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: weights[n] for n in names[s::shards]}
    save_file(part, str(path / file), metadata=meta)
    weight_map.update(dict.fromkeys(part, file))
  index = {"metadata": {"total_size": sum(a.nbytes for a in weights.values())},
           "weight_map": weight_map}
  (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  return path


def packed_row(rng, vocab: int):
  """tokens, segment ids, positions [T] of DOCS packed into one row, then padding."""
  seg = np.zeros(T, np.int32)
  pos = np.zeros(T, np.int32)
  start = 0
  for j, n in enumerate(DOCS):
    seg[start:start + n] = j + 1
    pos[start:start + n] = np.arange(n)
    start += n
  tokens = rng.integers(0, vocab, T).astype(np.int32)
  return tokens, seg, pos


def doc_slices():
  starts = np.cumsum((0,) + DOCS)
  return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


# ----------------------------------------------------------------------------------------------
# Our model
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _logits_fn(cfg: model_lib.ModelConfig):
  model = model_lib.Transformer(cfg, attn_lib.local_attention)
  return jax.jit(functools.partial(model.apply, method=model_lib.Transformer.logits))


def our_logits(cfg, params, tokens_BxT, seg_BxT, pos_BxT) -> np.ndarray:
  layout = attn_lib.Layout(jnp.asarray(seg_BxT), jnp.asarray(pos_BxT))
  with jax.default_matmul_precision("highest"):
    return np.asarray(_logits_fn(cfg)(params, jnp.asarray(tokens_BxT), layout))


def tolerance(ref) -> float:
  return RTOL * max(1.0, float(np.max(np.abs(ref))))


def assert_close(ours, ref, what):
  err, tol = float(np.max(np.abs(ours - ref))), tolerance(ref)
  print(f"{what}: max |ours - transformers| = {err:.3g}, max |logit| = {np.max(np.abs(ref)):.3g}")
  assert err <= tol, f"{what}: max |ours - transformers| = {err:.3g} > {tol:.3g}"


# ----------------------------------------------------------------------------------------------
# Fixture: every checkpoint, every input, one transformers subprocess
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
  dir: pathlib.Path
  hf: dict
  weights: dict[str, np.ndarray]   # float32 as written (bf16-rounded for bf16 storage)
  tokens_BxT: np.ndarray           # rows 0, 1: one document each; row 2: DOCS packed + padding
  seg_BxT: np.ndarray
  pos_BxT: np.ndarray
  ref: dict[str, np.ndarray]       # transformers logits: 'single' [2, T, V], 'doc{j}' [1, n, V]


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
  if not os.path.isfile(HF_PYTHON):
    pytest.fail(f"reference Python DISTCA_HF_PYTHON={HF_PYTHON!r} does not exist; create the "
                "test-only torch + transformers environment with `bash scripts/setup_hf_reference.sh` "
                "(or point DISTCA_HF_PYTHON at a Python that has torch and transformers)")
  return build_cases(tmp_path_factory.mktemp("hf"), np.random.default_rng(20240611), CASES)


def build_cases(root: pathlib.Path, rng, specs: dict) -> dict[str, Case]:
  """Every checkpoint of ``specs`` (name -> (config.json contents, storage dtype, shards)) with
  its inputs and transformers' logits (one subprocess)."""
  out, jobs = {}, []
  for name, (hf, dtype, shards) in specs.items():
    weights = random_hf_weights(hf, rng)
    if dtype == "bfloat16":  # what HF and we read back: the bf16-rounded values
      weights = {n: a.astype(ml_dtypes.bfloat16).astype(np.float32) for n, a in weights.items()}
    path = write_checkpoint(root / name, hf, weights, dtype=dtype, shards=shards)
    single = rng.integers(0, hf["vocab_size"], (2, T)).astype(np.int32)
    p_tok, p_seg, p_pos = packed_row(rng, hf["vocab_size"])
    tokens = np.concatenate([single, p_tok[None]])
    seg = np.concatenate([np.ones((2, T), np.int32), p_seg[None]])
    pos = np.concatenate([np.broadcast_to(np.arange(T, dtype=np.int32), (2, T)), p_pos[None]])
    inputs = {"single": single.tolist()}
    for j, sl in enumerate(doc_slices()):
      inputs[f"doc{j}"] = [p_tok[sl].tolist()]
    jobs.append({"checkpoint": str(path), "output": str(root / f"{name}.npz"), "inputs": inputs})
    out[name] = Case(path, hf, weights, tokens, seg, pos, {})
  run_reference(root, jobs)
  for name, case in out.items():
    with np.load(root / f"{name}.npz") as z:
      case.ref = {k: z[k] for k in z.files}
  return out


def run_reference(root: pathlib.Path, jobs: list[dict]) -> None:
  """transformers' logits for every job (checkpoint, inputs, output .npz), one subprocess."""
  job_file = root / "job.json"
  job_file.write_text(json.dumps({"jobs": jobs}))
  env = dict(os.environ, OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false",
             HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
  proc = subprocess.run([HF_PYTHON, str(REPO / "tests" / "hf_reference.py"), str(job_file)],
                        capture_output=True, text=True, timeout=300, env=env, check=False)
  if proc.returncode:
    pytest.fail(f"tests/hf_reference.py failed under {HF_PYTHON} (rc={proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def load(case: Case, **overrides):
  overrides = dict(dict(dtype="float32", remat="none"), **overrides)
  return hf_import.load_hf_checkpoint(case.dir, **overrides)


# ----------------------------------------------------------------------------------------------
# Parity with transformers
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name,scan_layers", [(n, True) for n in CASES] + [("mha_untied", False)])
def test_logits_equal_transformers(cases, name, scan_layers):
  """Single-document rows and a packed row (per document vs HF on that document alone)."""
  case = cases[name]
  cfg, params = load(case, scan_layers=scan_layers)
  logits = our_logits(cfg, params, case.tokens_BxT, case.seg_BxT, case.pos_BxT)
  assert logits.shape == (3, T, case.hf["vocab_size"])
  assert_close(logits[:2], case.ref["single"], f"{name} single-document rows")
  for j, sl in enumerate(doc_slices()):
    assert_close(logits[2, sl], case.ref[f"doc{j}"][0], f"{name} packed document {j}")


@pytest.mark.slow
def test_llama3_scaling_is_exercised(cases):
  """The scaled checkpoints would fail parity without the scaling: the tolerance has teeth."""
  for name in ("gqa_tied_llama3", "mqa_headdim_llama3_bf16_sharded"):
    case = cases[name]
    cfg, params = load(case)
    assert cfg.rope_scaling_factor == 8.0
    logits = our_logits(dataclasses.replace(cfg, rope_scaling_factor=0.0), params,
                        case.tokens_BxT, case.seg_BxT, case.pos_BxT)
    err = float(np.max(np.abs(logits[:2] - case.ref["single"])))
    assert err > 100 * tolerance(case.ref["single"]), f"{name}: unscaled RoPE agrees with HF ({err=}); scaling untested"


@pytest.mark.slow
def test_perturbing_one_document_leaves_the_others_unchanged(cases):
  case = cases["gqa_tied_llama3"]
  cfg, params = load(case)
  rng = np.random.default_rng(7)
  tokens, seg, pos = case.tokens_BxT[2], case.seg_BxT[2], case.pos_BxT[2]
  rows = [tokens]
  for sl in doc_slices():  # row j + 1: document j gets different tokens everywhere
    t = tokens.copy()
    t[sl] = (t[sl] + rng.integers(1, cfg.vocab_size, sl.stop - sl.start)) % cfg.vocab_size
    rows.append(t)
  n = len(rows)
  logits = our_logits(cfg, params, np.stack(rows), np.broadcast_to(seg, (n, T)),
                      np.broadcast_to(pos, (n, T)))
  base = logits[0]
  for j, sl in enumerate(doc_slices()):
    changed = logits[j + 1]
    assert np.max(np.abs(changed[sl] - base[sl])) > 1e-2, f"perturbing document {j} had no effect"
    others = np.ones(T, bool)
    others[sl] = False
    others &= seg != 0
    np.testing.assert_array_equal(changed[others], base[others],
                                  err_msg=f"perturbing document {j} changed another document")


# ----------------------------------------------------------------------------------------------
# Importer: tree, shards, bf16, placement
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("scan_layers", [True, False])
def test_params_tree_matches_model_init(cases, scan_layers):
  case = cases["gqa_tied_llama3"]
  cfg, params = load(case, scan_layers=scan_layers)
  model = model_lib.Transformer(cfg, attn_lib.local_attention)
  ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  want = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), ids, attn_lib.Layout(ids, ids)))
  got = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert jax.tree.leaves(got) == jax.tree.leaves(want)
  assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(params))


@pytest.mark.slow
def test_layout_transposes(cases):
  """Spot-check the mapping against the HF tensors directly (layer 1, scan layout)."""
  case = cases["mqa_headdim_llama3_bf16_sharded"]
  cfg, params = load(case)
  p, w = params["params"], case.weights
  e, h, k, d = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  pre, post = p["layers"]["layer"]["pre_ca"], p["layers"]["layer"]["post_ca"]
  hq = w["model.layers.1.self_attn.q_proj.weight"]  # [H*D, E]
  np.testing.assert_array_equal(pre["wq"][1, 3, 2, 5], hq[2 * d + 5, 3])
  np.testing.assert_array_equal(pre["wk"][1], w["model.layers.1.self_attn.k_proj.weight"].T
                                .reshape(e, k, d))
  np.testing.assert_array_equal(post["wo"][1, 3, 7, 11],
                                w["model.layers.1.self_attn.o_proj.weight"][11, 3 * d + 7])
  np.testing.assert_array_equal(post["w_down"][1], w["model.layers.1.mlp.down_proj.weight"].T)
  np.testing.assert_array_equal(p["lm_head"], w["lm_head.weight"].T)
  np.testing.assert_array_equal(p["final_norm"]["scale"], w["model.norm.weight"])


@pytest.mark.slow
def test_sharded_and_bf16_checkpoints_read_exactly(cases, tmp_path):
  """One file vs three shards + index, f32 vs bf16 storage: same arrays, bit for bit."""
  case = cases["mqa_headdim_llama3_bf16_sharded"]  # weights already bf16-representable
  single = write_checkpoint(tmp_path / "single_f32", case.hf, case.weights)
  cfg, from_single = hf_import.load_hf_checkpoint(single)
  _, from_sharded_bf16 = hf_import.load_hf_checkpoint(case.dir)
  assert (case.dir / "model.safetensors.index.json").exists()
  for a, b in zip(jax.tree.leaves(from_single), jax.tree.leaves(from_sharded_bf16)):
    assert a.dtype == b.dtype == np.float32
    np.testing.assert_array_equal(a, b)
  assert sum(a.size for a in jax.tree.leaves(from_single)) == cfg.num_params()


def test_mesh_placement(tmp_path):
  """mesh=: each array lands sharded by the logical rules, with the same values and logits."""
  hf = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)
  path = write_checkpoint(tmp_path / "ckpt", hf, random_hf_weights(hf, np.random.default_rng(3)))
  cfg = hf_import.model_config_from_hf(path, dtype="float32", remat="none")
  host = hf_import.load_hf_params(path, cfg)
  mesh = sharding_lib.make_mesh(data=2, tensor=4)
  placed = hf_import.load_hf_params(path, cfg, mesh=mesh)
  want = hf_import.param_shardings(cfg, mesh)
  wq = placed["params"]["layers"]["layer"]["pre_ca"]["wq"]
  # Layers on `pipe` (one stage here), heads on `tensor`: the rules table's placement.
  assert wq.sharding.spec == jax.sharding.PartitionSpec("pipe", None, "tensor", None)
  assert wq.addressable_shards[0].data.shape == (2, 32, 1, 8)  # a quarter of the heads
  for a, s, h in zip(jax.tree.leaves(placed), jax.tree.leaves(want), jax.tree.leaves(host)):
    assert a.sharding == s
    np.testing.assert_array_equal(np.asarray(a), h)
  rng = np.random.default_rng(4)
  tokens = rng.integers(0, 64, (2, T)).astype(np.int32)
  seg = np.ones((2, T), np.int32)
  pos = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))
  np.testing.assert_allclose(our_logits(cfg, placed, tokens, seg, pos),
                             our_logits(cfg, host, tokens, seg, pos), atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Config mapping and errors
# ----------------------------------------------------------------------------------------------
def test_config_mapping():
  cfg = hf_import.model_config_from_hf(full_hf_config(CASES["mqa_headdim_llama3_bf16_sharded"][0]))
  assert (cfg.vocab_size, cfg.dim, cfg.mlp_dim, cfg.n_layers) == (64, 40, 80, 2)
  assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 1, 12)
  assert (cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
          cfg.rope_high_freq_factor, cfg.rope_original_max_position) == (50000.0, 8.0, 1.0, 4.0, 32)
  assert (cfg.norm_eps, cfg.tie_embeddings) == (1e-5, False)
  v5 = hf_import.model_config_from_hf(full_hf_config(CASES["gqa_tied_llama3"][0]), scan_layers=False)
  assert (v5.rope_theta, v5.rope_scaling_factor, v5.tie_embeddings, v5.head_dim) == (
      10000.0, 8.0, True, 8)
  assert not v5.scan_layers
  minimal = hf_import.model_config_from_hf(dict(
      vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
      num_attention_heads=2, rope_scaling={"rope_type": "default"}))
  assert (minimal.n_kv_heads, minimal.head_dim, minimal.rope_theta, minimal.norm_eps,
          minimal.rope_scaling_factor, minimal.tie_embeddings) == (2, 8, 10000.0, 1e-6, 0.0, False)


@pytest.mark.parametrize("change,match", [
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "qwen2"}, "model_type='qwen2'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks .*low_freq_factor"),
    ({"hidden_size": None}, r"lacks required keys \['hidden_size'\]"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantized"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple of n_kv_heads=3"),
])
def test_config_errors(change, match):
  hf = full_hf_config(dict(CASES["mha_untied"][0], **change))
  with pytest.raises(hf_import.HFImportError, match=match):
    hf_import.model_config_from_hf(hf)


def test_unknown_override_is_an_error():
  with pytest.raises(hf_import.HFImportError, match=r"unknown ModelConfig overrides \['n_embd'\]"):
    hf_import.model_config_from_hf(full_hf_config(CASES["mha_untied"][0]), n_embd=3)


def _small(**hf_changes):
  hf = dict(CASES["mha_untied"][0], **hf_changes)
  return hf, random_hf_weights(hf, np.random.default_rng(11))


def test_checkpoint_errors_name_the_tensor_and_file(tmp_path):
  hf, w = _small()
  cfg = hf_import.model_config_from_hf(full_hf_config(hf))

  def expect(weights, match, *, config=hf, shards=1, sub):
    path = write_checkpoint(tmp_path / sub, config, weights, shards=shards)
    with pytest.raises(hf_import.HFImportError, match=match):
      hf_import.load_hf_params(path, cfg)
    return path

  up = "model.layers.1.mlp.up_proj.weight"
  expect({n: a for n, a in w.items() if n != up}, rf"\['{up}'\].*missing from checkpoint.*"
         r"model-0000\d-of-00002.safetensors", shards=2, sub="missing")
  bad = dict(w, **{"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 32), np.float32)})
  expect(bad, r"'model.layers.0.self_attn.k_proj.weight' in '.*shape/model.safetensors' has "
         r"shape \(16, 32\), but the config implies \(32, 32\)", sub="shape")
  extra = dict(w, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(32, np.float32)})
  expect(extra, r"no place for: \['model.layers.0.self_attn.q_proj.bias'\]", sub="extra")
  expect({n: a for n, a in w.items() if n != "lm_head.weight"},
         r"\['lm_head.weight'\].*missing.*tie_word_embeddings=false", sub="nohead")
  tied_cfg = dataclasses.replace(cfg, tie_embeddings=True)
  path = write_checkpoint(tmp_path / "tied", dict(hf, tie_word_embeddings=True), w)
  with pytest.raises(hf_import.HFImportError, match="lm_head.weight.*differs from"):
    hf_import.load_hf_params(path, tied_cfg)
  # More layers in the weights than in the config.
  with pytest.raises(hf_import.HFImportError, match=r"no place for: \['model.layers.1.input_"):
    hf_import.load_hf_params(path, dataclasses.replace(cfg, n_layers=1))

  path = write_checkpoint(tmp_path / "index", hf, w, shards=2)
  (path / "model-00002-of-00002.safetensors").unlink()
  with pytest.raises(hf_import.HFImportError, match="to 'model-00002-of-00002.safetensors', which "
                     "is not in"):
    hf_import.load_hf_params(path, cfg)
  (tmp_path / "empty").mkdir()
  with pytest.raises(hf_import.HFImportError, match=r"no \*.safetensors files in"):
    hf_import.load_hf_params(tmp_path / "empty", cfg)
  with pytest.raises(hf_import.HFImportError, match="no Hugging Face config at"):
    hf_import.model_config_from_hf(tmp_path / "empty")

  # Tolerated: the rotary inv_freq buffers older checkpoints carry.
  inv = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32) for i in (0, 1)}
  path = write_checkpoint(tmp_path / "inv_freq", hf, dict(w, **inv))
  hf_import.load_hf_params(path, cfg)


def test_cli_check(tmp_path, capsys):
  hf, w = _small()
  path = write_checkpoint(tmp_path / "ok", hf, w, shards=2)
  assert hf_import.main([str(path), "--check"]) == 0
  out = capsys.readouterr().out
  cfg = hf_import.model_config_from_hf(path)
  assert "n_kv_heads = 4" in out and "rope_theta = 10000.0" in out
  assert f"parameters: {cfg.num_params():,} OK" in out
  broken = write_checkpoint(tmp_path / "broken", hf,
                            {n: a for n, a in w.items() if n != "model.norm.weight"})
  assert hf_import.main([str(broken), "--check"]) == 1
  assert "'model.norm.weight'] (1 in all) missing" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Export (hf_export): round trip and transformers
# ----------------------------------------------------------------------------------------------
def _written_case(root: pathlib.Path, name: str, seed: int) -> tuple[pathlib.Path, dict]:
  """A random checkpoint of CASES[name] written under root; (its dir, the weights as stored)."""
  hf, dtype, shards = CASES[name]
  weights = random_hf_weights(hf, np.random.default_rng(seed))
  if dtype == "bfloat16":
    weights = {n: a.astype(ml_dtypes.bfloat16).astype(np.float32) for n, a in weights.items()}
  return write_checkpoint(root / name, hf, weights, dtype=dtype, shards=shards), weights


def _tensors(path: pathlib.Path) -> dict[str, tuple[str, tuple, bytes]]:
  """name -> (safetensors dtype, shape, raw bytes) of every tensor in the checkpoint's files."""
  out = {}
  for file in sorted(path.glob("*.safetensors")):
    header, data_start = hf_import._read_header(str(file))
    raw = file.read_bytes()
    for name, info in header.items():
      if name != "__metadata__":
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], tuple(info["shape"]), raw[data_start + a:data_start + b])
  return out


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("scan_layers", [True, False])
def test_export_round_trip_is_bit_exact(tmp_path, seed, name, scan_layers):
  """import -> export writes every tensor of the checkpoint bit for bit (at its storage dtype,
  one file and several), and the exported config.json maps back to the same ModelConfig."""
  src, _ = _written_case(tmp_path, name, seed)
  dtype = CASES[name][1]
  cfg, params = hf_import.load_hf_checkpoint(src, scan_layers=scan_layers)
  for label, shard_bytes in (("one", hf_export.MAX_SHARD_BYTES), ("many", 4096)):
    out = tmp_path / f"out_{label}"
    names = hf_export.export_hf(params, cfg, str(out), dtype=dtype, max_shard_bytes=shard_bytes)
    assert (len(names) == 1) == (label == "one")
    assert (out / "model.safetensors.index.json").exists() == (label == "many")
    a, b = _tensors(src), _tensors(out)
    assert sorted(a) == sorted(b) and len(a) > 0
    for n in a:
      assert a[n] == b[n], f"{name} {label}: {n} differs"
    assert hf_import.model_config_from_hf(out, scan_layers=scan_layers) == cfg
    _, again = hf_import.load_hf_checkpoint(out, scan_layers=scan_layers)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y), params, again)


def test_export_rejects_params_of_another_config(tmp_path, seed):
  src, _ = _written_case(tmp_path, "mha_untied", seed)
  cfg, params = hf_import.load_hf_checkpoint(src)
  other = dataclasses.replace(cfg, mlp_dim=cfg.mlp_dim * 2)
  with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(64, 32\) "
                                       r"in HF layout, but the model config implies \(128, 32\)"):
    hf_export.export_hf(params, other, str(tmp_path / "out"))


@pytest.mark.slow
def test_exported_checkpoints_give_transformers_our_logits(cases, tmp_path):
  """Each case's parameters, exported by hf_export and loaded by transformers'
  LlamaForCausalLM.from_pretrained: its logits equal ours (the same tolerance as the import)."""
  jobs = []
  for name, case in cases.items():
    cfg, params = load(case)
    out = tmp_path / name
    hf_export.export_hf(params, cfg, str(out), dtype=CASES[name][1])
    jobs.append({"checkpoint": str(out), "output": str(tmp_path / f"{name}.npz"),
                 "inputs": {"single": case.tokens_BxT[:2].tolist()}})
  run_reference(tmp_path, jobs)
  for name, case in cases.items():
    cfg, params = load(case)
    logits = our_logits(cfg, params, case.tokens_BxT, case.seg_BxT, case.pos_BxT)
    with np.load(tmp_path / f"{name}.npz") as z:
      assert_close(logits[:2], z["single"], f"{name} exported")


# ----------------------------------------------------------------------------------------------
# Fine-tuning from a HF checkpoint (config init_from_hf)
# ----------------------------------------------------------------------------------------------
def _finetune_config(*over):
  from distca_jax import configs_io
  return configs_io.load_config(str(REPO / "configs" / "tiny_cpu.py"), [
      "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
      "model.head_dim=16", "model.mlp_dim=128", "model.loss_chunk=64", "tokens_per_rank=128",
      "rows_per_rank=2", "mesh.data=4", "mesh.tensor=2", "checkpoint_every=0", "tensorboard=False",
      "eval_steps=2", "optim.warmup_steps=2", "attention.block_q=32", "attention.block_k=32",
      *over])


def _hf_for(c, root: pathlib.Path, seed: int) -> pathlib.Path:
  """A random HF checkpoint with config c's architecture (hf_export.hf_config of it)."""
  from distca_jax import config as config_lib
  hf = hf_export.hf_config(config_lib.model_config(c))
  weights = random_hf_weights(hf, np.random.default_rng(seed))
  return write_checkpoint(root, hf, weights)


def test_init_from_hf_with_another_architecture_is_one_line(tmp_path, seed):
  from distca_jax import trainer
  src = _hf_for(_finetune_config("model.mlp_dim=96"), tmp_path / "hf", seed)
  c = _finetune_config(f"init_from_hf={src}", "num_steps=2")
  with pytest.raises(ValueError, match=r"^init_from_hf=.*: the checkpoint's model differs from "
                                       r"config.model \(model.mlp_dim=128 vs 96\); set "
                                       r"--config.model.mlp_dim=96$"):
    trainer.train_and_evaluate(c, str(tmp_path / "run"))
  assert not (tmp_path / "run").exists()  # checked before the workdir is made


@pytest.mark.slow
def test_finetune_from_hf_checkpoint_lowers_the_validation_loss(tmp_path, seed, capsys):
  """A run with init_from_hf starts from the checkpoint's weights (its first batch's loss is
  that of the HF parameters, not of a fresh init) and 20 steps lower its held-out loss; the
  run's checkpoint exports back to a HF checkpoint that imports to the trained parameters."""
  from distca_jax import trainer
  src = _hf_for(_finetune_config(), tmp_path / "hf", seed)
  c = _finetune_config(f"init_from_hf={src}", "num_steps=20", "log_every=1", "eval_every=20",
                       "optim.lr=0.003", "checkpoint_every=20")
  run = trainer.setup_run(c)
  params = trainer.params_from_hf(c, run.state_shardings.params)
  rows = run.mesh.shape["data"] * c.rows_per_rank
  before = trainer.Evaluator(c, run, [(0, rows)])(params, run.model)["eval_loss"]
  first = trainer.local_batch(run.source, 0, [(0, rows)], run.backend, run.source.doclens(0))[0]
  with trainer.mesh_context(run.mesh, c.mesh.fsdp):
    total, count = jax.jit(lambda p, b: trainer.loss_sums(c, p, b, run.model))(
        params, trainer.device_batch(first, run.mesh, rows))
  records = trainer.train_and_evaluate(c, str(tmp_path / "run"))
  assert "parameters from the Hugging Face checkpoint" in capsys.readouterr().out
  np.testing.assert_allclose(records[0]["loss"], float(total) / float(count), rtol=1e-5)
  after = records[-1]["eval_loss"]
  print(f"held-out loss: {before:.4f} at the HF weights -> {after:.4f} after 20 steps")
  assert after < before - 0.5
  step, _ = hf_export.export_run(str(tmp_path / "run"), str(tmp_path / "exported"))
  assert step == 20
  _, back = hf_import.load_hf_checkpoint(tmp_path / "exported")
  assert not np.array_equal(back["params"]["embedding"], np.asarray(params["embedding"]))
