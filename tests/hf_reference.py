"""Reference logits from transformers (torch, CPU, float32, eager attention): the architecture
config.json names (LlamaForCausalLM, MistralForCausalLM), through AutoModelForCausalLM.

Runs in the separate test-only environment made by `bash scripts/setup_hf_reference.sh`
(.venv-hf: torch + transformers), never in the JAX venv. tests/test_hf_parity.py calls it once
for all checkpoints:

    .venv-hf/bin/python tests/hf_reference.py JOB.json

JOB.json: {"jobs": [{"checkpoint": DIR, "output": OUT.npz,
                     "inputs": {NAME: [[token ids of row 0], [row 1], ...], ...}}, ...]}
Each NAME's rows (all the same length) run as one batch without padding; OUT.npz gets NAME ->
logits [B, T, V] float32. Loading fails loudly if any weight is missing, unexpected or mismatched,
so a bad checkpoint can never be compared against randomly initialized weights.
"""

import json
import sys

import numpy as np
import torch
import transformers


def main(job_path: str) -> None:
  torch.set_num_threads(2)
  with open(job_path) as f:
    jobs = json.load(f)["jobs"]
  for job in jobs:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        job["checkpoint"], dtype=torch.float32, attn_implementation="eager",
        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"} 
    if bad or info.get("error_msgs"):
      raise SystemExit(f"{job['checkpoint']}: transformers did not load every weight: {info}")
    model.eval()
    out = {}
    with torch.no_grad():
      for name, rows in job["inputs"].items():
        ids = torch.tensor(rows, dtype=torch.long)
        out[name] = model(input_ids=ids).logits.float().numpy()
    np.savez(job["output"], **out)
  print(f"transformers {transformers.__version__} torch {torch.__version__}: {len(jobs)} checkpoints")


if __name__ == "__main__":
  main(sys.argv[1])
