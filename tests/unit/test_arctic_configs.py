"""ArcticTraining run configs, written in the shape of its published ``projects/`` recipes (built-in trainers
and components only; model and data pointed at local paths), validate unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import load_config

SFT_OFFLOAD = """\
type: sft
micro_batch_size: 1
gradient_accumulation_steps: 4
exit_iteration: 100
min_iterations: 10
activation_checkpoint_cpu_offload: true
tiled_mlp_compute: true
deepspeed:
  zero_optimization:
    stage: 3
    offload_optimizer: {device: cpu, pin_memory: true}
    offload_param: {device: cpu}
  bf16: {enabled: true}
optimizer:
  type: cpu_adam
  learning_rate: 1e-5
  weight_decay: 0.0
  betas: [0.9, 0.95]
model:
  type: liger
  name_or_path: ./model
  attn_implementation: sdpa
  dtype: bf16
data:
  sources:
    - type: local
      name_or_path: ./train.jsonl
  max_length: 4096
  cache_dir: ./data-cache
  num_proc: 16
logger:
  level: WARNING
  output_dir: logs
  print_output_ranks: [0]
checkpoint:
  - type: huggingface
    save_end_of_training: true
    output_dir: ./fine-tuned-model
scheduler:
  type: huggingface
  name: cosine
  warmup_ratio: 0.05
wandb:
  enable: false
  project: my-project
"""

SFT_FUSED_LONG = """\
type: sft
micro_batch_size: 1
sequence_parallel_size: 2
train_iters: 50
eval_frequency: 10
deepspeed:
  zero_optimization: {stage: 2}
optimizer:
  type: fused_adam
  lr: 2e-5
model:
  type: liger
  name_or_path: ./model
  attn_implementation: flash_attention_2
data:
  sources: [./train.jsonl]
  eval_sources: [./eval.jsonl]
  max_length: 32768
  pack_samples: true
checkpoint:
  - type: deepspeed
    auto_resume: true
    save_every_n_steps: 25
    output_dir: ./ckpt
"""

DPO = """\
type: dpo
micro_batch_size: 2
epochs: 1
beta: 0.1
deepspeed:
  zero_optimization: {stage: 3}
optimizer:
  type: fused_adam
  learning_rate: 5e-7
model:
  type: liger
  name_or_path: ./model
ref_model:
  type: huggingface
  name_or_path: ./model
data:
  sources:
    - type: local
      name_or_path: ./prefs.jsonl
  max_length: 2048
"""


@pytest.mark.parametrize("text", [SFT_OFFLOAD, SFT_FUSED_LONG, DPO], ids=["sft-offload", "sft-long", "dpo"])
def test_arctic_training_recipes_validate_unchanged(tmp_path: Path, text: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    config = load_config(path)
    assert config.model.type == "liger"
    assert config.optimizer.type in ("cpu_adam", "fused_adam")
