"""Vision-language SFT speed: ``posttrain train`` (``type: sft``) against TRL's ``SFTTrainer`` on the same tiny
VLM, rows and batch, measured in one run; padded and (posttrain) packed.

    python benchmarks/vision_sft.py [--arch idefics3] [--rows 256] [--steps 12] [--json out.json]

The model is the tiny Idefics3 (SmolVLM's architecture) of ``posttrain tiny-model --arch idefics3`` at hidden
``--hidden`` (default 256) and 4 layers, float32 on this CPU; the rows are the vision demo's coloured squares
in TRL's layout (``{"type": "image"}`` parts and an ``images`` column), 16 rows per step, AdamW at lr 1e-4,
the tower and projector trained (TRL trains every parameter; posttrain's defaults would freeze them).
Each runner trains in a fresh process; tokens (and images) per second are taken from the step times after
two warm-up steps: posttrain's from its metrics file, TRL's from a callback at each step's end, as rows per
second (one image a row); tokens per second are rows per second times the rows' mean length as the processor
makes them (image tokens included), the same for both. Neither checkpoints activations.

TRL is not a dependency: the script installs ``trl`` with pip into ``benchmarks/.trl`` when it is missing (and
the index is reachable); without it the TRL row is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "demo-out" / "bench-vision"
TRL_DIR = ROOT / "benchmarks" / ".trl"
BATCH = 16


def _trl_path() -> str | None:
    try:
        import trl  # noqa: F401

        return ""
    except ImportError:
        pass
    if not (TRL_DIR / "trl").is_dir():
        command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TRL_DIR), "trl"]
        if subprocess.run(command, check=False).returncode != 0:
            return None
    return str(TRL_DIR)


def prepare(arch: str, hidden: int, rows: int) -> tuple[Path, Path]:
    sys.path.insert(0, str(ROOT / "src"))
    from posttrain.testing.data import write_jsonl
    from posttrain.testing.vision import colour_rows
    from posttrain.vision.tiny import write_tiny_vlm

    model = WORK / f"{arch}-{hidden}"
    if not model.exists():
        write_tiny_vlm(model, arch, hidden_size=hidden, layers=4, heads=4)
    data = WORK / "train.jsonl"
    write_jsonl(data, colour_rows(WORK, rows, seed=1))
    return model, data


def run_posttrain(model: Path, data: Path, steps: int, packed: bool) -> dict[str, float]:
    import yaml

    out = WORK / ("posttrain-packed" if packed else "posttrain")
    config: dict[str, Any] = {
        "type": "sft",
        "model": {
            "name_or_path": str(model),
            "dtype": "float32",
            "freeze_vision_tower": False,
            "freeze_multi_modal_projector": False,
            "disable_activation_checkpoint": True,
        },
        "data": {"sources": [str(data)], "max_length": 64, "cache_dir": str(WORK / "cache"), "seed": 0},
        "micro_batch_size": BATCH,
        "train_iters": steps,
        "optimizer": {"lr": 1e-4},
        "scheduler": {"name": "constant", "warmup_ratio": 0},
        "logger": {"output_dir": str(out)},
        "loss_log_interval": 0,
    }
    if packed:  # 16 rows of about 30 tokens in each packed sequence
        config.update(micro_batch_size=1, data={**config["data"], "pack_samples": True, "max_length": 512})
    path = WORK / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "posttrain", "train", str(path)], check=True, capture_output=True, text=True
    )
    lines = [json.loads(x) for x in (out / "train-log-metrics.jsonl").read_text().splitlines()]
    timed = [x for x in lines if "step_time" in x][2:]
    seconds = sum(x["step_time"] for x in timed)
    per_step = float(BATCH)
    found = re.search(r"(\d+) samples, packed into (\d+) sequences", done.stdout + done.stderr)
    if packed and found:  # the rows a packed sequence holds, on average
        per_step = int(found.group(1)) / int(found.group(2))
    return {"rows_per_second": per_step * len(timed) / seconds, "steps_per_second": len(timed) / seconds}


TRL_SCRIPT = r"""
import json, sys, time
from pathlib import Path
import torch
from datasets import Dataset
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
from trl import SFTConfig, SFTTrainer

model_dir, data, steps, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = [json.loads(x) for x in data.read_text().splitlines()]
for row in rows:
    row["images"] = [Image.open(data.parent / p).convert("RGB") for p in row["images"]]
dataset = Dataset.from_list(rows)
processor = AutoProcessor.from_pretrained(model_dir)
model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
times = []

class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.start = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.start)

config = SFTConfig(
    output_dir=out, per_device_train_batch_size=BATCH_SIZE, max_steps=steps, learning_rate=1e-4,
    lr_scheduler_type="constant", logging_steps=1000, save_strategy="no", report_to=[], use_cpu=True,
    max_length=None, dataloader_num_workers=0, seed=0, assistant_only_loss=False, completion_only_loss=False,
    gradient_checkpointing=False, bf16=False, fp16=False,
)
trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=processor, callbacks=[Clock()])
trainer.train()
print("TIMES " + json.dumps(times))
"""


def run_trl(model: Path, data: Path, steps: int, trl_path: str) -> dict[str, float]:
    script = WORK / "trl_sft.py"
    script.write_text(TRL_SCRIPT.replace("BATCH_SIZE", str(BATCH)))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (trl_path, os.environ.get("PYTHONPATH")) if p),
    }
    done = subprocess.run(
        [sys.executable, str(script), str(model), str(data), str(steps), str(WORK / "trl-out")],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    times = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("TIMES "))[6:])[2:]
    return {"steps_per_second": len(times) / sum(times), "rows_per_second": BATCH * len(times) / sum(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch",
        default="idefics3",
        choices=("idefics3", "llava", "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"),
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    WORK.mkdir(parents=True, exist_ok=True)
    model, data = prepare(args.arch, args.hidden, args.rows)
    tokens_per_row = _tokens_per_row(model, data)
    results: dict[str, dict[str, float]] = {}
    started = time.time()
    results["posttrain padded"] = run_posttrain(model, data, args.steps, packed=False)
    results["posttrain packed"] = run_posttrain(model, data, args.steps, packed=True)
    trl_path = _trl_path()
    if trl_path is None:
        print("TRL is not installed and pip could not install it: its row is skipped")
    else:
        results["TRL SFTTrainer padded"] = run_trl(model, data, args.steps, trl_path)
    for row in results.values():  # one image a row
        row["images_per_second"] = row["rows_per_second"]
        row["tokens_per_second"] = row["rows_per_second"] * tokens_per_row
    base = results.get("TRL SFTTrainer padded")
    print(
        f"{args.arch} hidden {args.hidden}, {BATCH} rows per step, {args.steps} steps ({time.time() - started:.0f} s)"
    )
    print(f"{'runner':<24} {'tokens/s':>10} {'images/s':>10} {'vs TRL':>8}")
    for name, row in results.items():
        ratio = f"{row['tokens_per_second'] / base['tokens_per_second']:.2f}x" if base else "-"
        print(f"{name:<24} {row['tokens_per_second']:>10.0f} {row['images_per_second']:>10.1f} {ratio:>8}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def _tokens_per_row(model: Path, data: Path) -> float:
    """The rows' mean length in tokens as the processor makes them (one image each): what a step holds."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    lengths = []
    for row in rows[:32]:
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        image = Image.open(data.parent / row["images"][0]).convert("RGB")
        lengths.append(
            len(processor(text=[text], images=[[image]], add_special_tokens=False)["input_ids"][0])
        )
    return statistics.mean(lengths)


if __name__ == "__main__":
    sys.exit(main())
