"""Our top-level packages (`kernels`, `convert`, ...) must not confuse transformers.

transformers probes for Hugging Face's own `kernels` package by import name; with this project installed,
`import kernels` finds ours. The probe must still decide "not available" and a DeepSeek forward must run.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import kernels, convert, shard, manifest, runner, comm  # ours, importable next to transformers
import torch
import transformers
from transformers.utils.import_utils import is_kernels_available
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

assert kernels.__file__.startswith(REPO), kernels.__file__
assert not is_kernels_available(), "transformers mistook our kernels package for HF kernels"
torch.manual_seed(0)
config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                          n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                          first_k_dense_replace=1)
model = DeepseekV3ForCausalLM(config).eval()
with torch.no_grad():
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
assert logits.shape == (1, 4, 64) and torch.isfinite(logits).all()
print("ok")
"""


def test_transformers_deepseek_forward_with_project_installed():
    code = f"REPO = {str(REPO)!r}\n" + SCRIPT
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
