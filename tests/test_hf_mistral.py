"""HF Mistral import: our logits equal transformers' MistralForCausalLM, sliding window included.

Tiny random Mistral checkpoints (Llama's tensors, a `sliding_window` shorter than the documents)
are written as in tests/test_hf_parity.py and compared, within its tolerance, with transformers'
logits (`tests/hf_reference.py` in the test-only .venv-hf). A window one token off, or no window,
must fail the same comparison: the window really shapes these logits.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from distca_jax import hf_export, hf_import
from distca_jax import layer_types as types_lib
from distca_jax.errors import UserError
from test_hf_parity import (HF_PYTHON, Case, assert_close, build_cases, doc_slices, load,
                            our_logits, tolerance)

WINDOW = 5  # shorter than the single-document rows (T = 32) and the packed documents 9 and 14

CASES = {
    "mistral_gqa": dict(
        vocab_size=83, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, sliding_window=WINDOW),
    "mistral_headdim_tied": dict(
        vocab_size=64, hidden_size=40, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, rope_theta=50000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, sliding_window=WINDOW + 3),
}


def mistral(hf: dict) -> dict:
  return dict(hf, architectures=["MistralForCausalLM"], model_type="mistral")


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
  if not os.path.isfile(HF_PYTHON):
    pytest.fail(f"reference Python DISTCA_HF_PYTHON={HF_PYTHON!r} does not exist; create it with "
                "`bash scripts/setup_hf_reference.sh`")
  specs = {name: (mistral(hf), "float32", 1) for name, hf in CASES.items()}
  return build_cases(tmp_path_factory.mktemp("hf_mistral"), np.random.default_rng(20261207),
                     specs)


@pytest.mark.slow
@pytest.mark.parametrize("name,scan_layers", [(n, True) for n in CASES] + [("mistral_gqa", False)])
def test_logits_equal_transformers(cases, name, scan_layers):
  """Single-document rows and a packed row (per document vs HF on that document alone)."""
  case = cases[name]
  cfg, params = load(case, scan_layers=scan_layers)
  assert cfg.layer_types == (types_lib.LayerType("window", case.hf["sliding_window"]),) * cfg.n_layers
  logits = our_logits(cfg, params, case.tokens_BxT, case.seg_BxT, case.pos_BxT)
  assert_close(logits[:2], case.ref["single"], f"{name} single-document rows")
  for j, sl in enumerate(doc_slices()):
    assert_close(logits[2, sl], case.ref[f"doc{j}"][0], f"{name} packed document {j}")


@pytest.mark.slow
@pytest.mark.parametrize("change", [dict(window=WINDOW + 1), dict(window=WINDOW - 1),
                                    dict(layer_pattern="", window=0)])
def test_a_wrong_window_fails_parity(cases, change):
  case = cases["mistral_gqa"]
  cfg, params = load(case)
  logits = our_logits(dataclasses.replace(cfg, **change), params, case.tokens_BxT, case.seg_BxT,
                      case.pos_BxT)
  err = float(np.max(np.abs(logits[:2] - case.ref["single"])))
  assert err > 100 * tolerance(case.ref["single"]), f"{change}: agrees with HF ({err=})"


def test_mistral_config_mapping():
  cfg = hf_import.model_config_from_hf(mistral(CASES["mistral_gqa"]))
  assert (cfg.layer_pattern, cfg.window, cfg.chunk) == ("local", WINDOW, 0)
  no_key = {k: v for k, v in mistral(CASES["mistral_gqa"]).items() if k != "sliding_window"}
  assert hf_import.model_config_from_hf(no_key).window == 4096  # transformers' default
  full = hf_import.model_config_from_hf(dict(mistral(CASES["mistral_gqa"]), sliding_window=None))
  assert full.layer_types == (types_lib.FULL_TYPE,) * 2
  exported = hf_export.hf_config(cfg)
  assert (exported["model_type"], exported["sliding_window"]) == ("mistral", WINDOW)
  assert hf_import.model_config_from_hf(exported) == cfg
  assert "sliding_window" not in hf_export.hf_config(full)


@pytest.mark.parametrize("hf,match", [
    (dict(sliding_window=0), r"sliding_window=0 must be a positive integer or null"),
    (dict(layer_types=["sliding_attention"] * 2), r"per-layer layer_types are not imported"),
    (dict(model_type="llama", sliding_window=8), r"sliding_window / layer_types in a 'llama'"),
    (dict(model_type="qwen2"), r"model_type='qwen2'; only 'llama' and 'mistral'"),
])
def test_mistral_config_errors(hf, match):
  with pytest.raises(hf_import.HFImportError, match=match):
    hf_import.model_config_from_hf(dict(mistral(CASES["mistral_gqa"]), **hf))


def test_export_refuses_mixed_layer_types():
  cfg = hf_import.model_config_from_hf(mistral(CASES["mistral_gqa"]))
  with pytest.raises(UserError, match=r"only all-full \(Llama\) or all-window \(Mistral\)"):
    hf_export.hf_config(dataclasses.replace(cfg, layer_pattern="1:1"))
