"""``posttrain convert``: read a file, detect its system, convert, write the commented config."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from posttrain.convert.axolotl import AXOLOTL
from posttrain.convert.base import (
    SAME,
    UNSUPPORTED,
    Conversion,
    System,
    convert,
    render_lines,
    rules_markdown,
)
from posttrain.convert.erniekit import ERNIEKIT
from posttrain.convert.hf_args import INLINE_TEMPLATE
from posttrain.convert.llama_factory import LLAMA_FACTORY
from posttrain.convert.megatron_bridge import MEGATRON_BRIDGE
from posttrain.convert.silogen import SILOGEN
from posttrain.convert.trl import TRL
from posttrain.errors import UserError
from posttrain.utils.fs import atomic_write_text

SYSTEMS: dict[str, System] = {
    system.name: system for system in (SILOGEN, ERNIEKIT, MEGATRON_BRIDGE, TRL, AXOLOTL, LLAMA_FACTORY)
}

INTROS = {
    "silogen": "`posttrain convert engine.yaml --from silogen -o run.yaml` reads a SiloGen finetuning engine config "
    "(`method`, `data_conf`, `training_args`, `batchsize_conf`, `peft_conf`, `quant_conf`, `run_conf`, "
    "`sft_args`, `tracking`, `overrides`), also nested under `finetuning_config:` in a Helm values file with "
    "`finetuningGpus`, `distributedType`, `basemodel` and `mergeAdapter` beside it. SiloGen's JSONL rows "
    "(`messages`; `prompt_messages`/`chosen_messages`/`rejected_messages`) load as they are.",
    "erniekit": "`posttrain convert run_sft.yaml --from erniekit -o run.yaml` reads ERNIEKit's flat run configs "
    "(and the nested `model_args`/`trainer_args` form). Its `erniekit` and `chatml` JSONL rows load as they "
    "are; comma-separated `train_dataset_path`/`_prob`/`_type` become weighted sources. The learning-rate "
    "schedule becomes `scheduler: {type: megatron}` (warmup steps, decay style, `min_lr`).",
    "megatron-bridge": "`posttrain convert config.yaml --from megatron-bridge -o run.yaml` reads a "
    "Megatron-Bridge `ConfigContainer` YAML (a partial override or a full dump with `_target_` entries). A "
    "`blend`/`data_path` becomes weighted `type: megatron` sources (pretraining, `type: causal`); a "
    "`dataset_root` becomes its `training.jsonl`/`validation.jsonl` (fine-tuning, `type: sft`, rows of "
    "`input`/`output` or chat messages). Model-parallel sizes other than 1 are reported with what posttrain "
    "offers instead.",
    "trl": "`posttrain convert sft.yaml --from trl -o run.yaml` reads the YAML or JSON a `trl sft` (or dpo, grpo, kto) "
    "`--config` run reads (as the alignment handbook and open-r1 publish them): `ModelConfig` (`use_peft`, "
    "`lora_*`), `ScriptArguments` (`dataset_name`, the handbook's `dataset_mixture`) and the trainer's config "
    "(`SFTConfig`, `DPOConfig`, `KTOConfig`, `GRPOConfig`: all `TrainingArguments`), flat. The trainer comes "
    "from its own keys (`num_generations`: GRPO; `desirable_weight`: KTO; `beta`: DPO; else SFT) and the "
    "report says which. GRPO's `reward_funcs` are Python: write them under `rewards:`.",
    "axolotl": "`posttrain convert config.yml --from axolotl -o run.yaml` reads an Axolotl config: "
    "`base_model`, `datasets` (path, split, `type`, `field_messages`...), `adapter: lora|qlora` with "
    "`lora_*`, `rl` (dpo, ipo, orpo, simpo, kto or grpo; TRL's settings under `trl:`), `sequence_len`, "
    "`sample_packing`, `micro_batch_size`, `num_epochs`, `evals_per_epoch`/`saves_per_epoch` (a share of "
    "the run), and the `TrainingArguments` names it passes through.",
    "llama-factory": "`posttrain convert llama3_lora_sft.yaml --from llama-factory -o run.yaml` reads a "
    "LLaMA-Factory training config: `stage` (sft, pt, dpo, kto, rm), `finetuning_type: lora|full` with "
    "`lora_rank`/`lora_target`, `pref_beta`/`pref_loss`, the freeze keys of vision-language models, "
    "`template`, `cutoff_len`, and `dataset` names looked up in `<dataset_dir>/dataset_info.json` (beside "
    "the config or in the working directory: each name's file and its `sharegpt`/`alpaca` columns and tags).",
}


#: keys only one system writes (checked in this order: TRL's files share names with ERNIEKit's and
#: LLaMA-Factory's, so they come last among the three)
LLAMA_FACTORY_KEYS = {"finetuning_type", "cutoff_len", "template", "lora_target", "pref_beta", "dataset_dir"}
AXOLOTL_KEYS = {
    "base_model",
    "micro_batch_size",
    "sequence_len",
    "num_epochs",
    "sample_packing",
    "adapter",
    "rl",
}
ERNIEKIT_KEYS = {"stage", "fine_tuning", "train_dataset_path", "max_seq_len", "model_args", "trainer_args"}
TRL_KEYS = {
    "model_name_or_path",
    "dataset_name",
    "dataset_mixture",
    "per_device_train_batch_size",
    "learning_rate",
    "num_generations",
    "use_peft",
}


def detect(data: dict[str, Any]) -> str:
    """The source system from the file's keys."""
    keys = set(data)
    if "finetuning_config" in keys or keys & {"data_conf", "training_args", "run_conf", "batchsize_conf"}:
        return "silogen"
    if keys & LLAMA_FACTORY_KEYS:
        return "llama-factory"
    if str(data.get("stage", "")) in ("sft", "pt", "dpo", "kto", "rm", "ppo"):  # ERNIEKit writes SFT, DPO...
        return "llama-factory"
    if keys & ERNIEKIT_KEYS:
        return "erniekit"
    if keys & AXOLOTL_KEYS:
        return "axolotl"
    bridge = {
        "train",
        "optimizer",
        "scheduler",
        "dataset",
        "checkpoint",
        "logger",
        "rng",
        "peft",
        "model",
        "_target_",
    }
    target = str(data.get("_target_", ""))
    if target.endswith("ConfigContainer") or isinstance(data.get("ConfigContainer"), dict):
        return "megatron-bridge"  # a ConfigContainer.to_yaml() dump, or the perf scripts' wrapped layout
    sections = [key for key in keys & bridge if key != "_target_" and data[key] is not None]  # peft: null
    if sections and all(isinstance(data[key], dict) for key in sections):
        return "megatron-bridge"
    if keys & TRL_KEYS:
        return "trl"
    raise UserError(
        "cannot tell which system wrote this config (no SiloGen, ERNIEKit, Megatron-Bridge, TRL, Axolotl or "
        f"LLaMA-Factory keys); name it with --from {'|'.join(SYSTEMS)}"
    )


#: a number PyYAML leaves a string (YAML 1.1 wants a dot and a signed exponent: ``2e-5``, ``1e3``), which the
#: other trainers' argument parsers read as the float it is
_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _numbers(value: Any) -> Any:
    if isinstance(value, str) and _SCIENTIFIC.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, dict):
        return {key: _numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_numbers(item) for item in value]
    return value


def read_source(path: Path) -> dict[str, Any]:
    """A YAML or JSON config (TRL's parser reads both)."""
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else _numbers(yaml.safe_load(text))
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; save it as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON: {exc}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys")
    return data


def render_config(conv: Conversion, source: Path) -> str:
    """The converted config as YAML, each top-level key preceded by where its values came from."""
    title = SYSTEMS[conv.system].title
    out = [
        f"# posttrain config converted from {title}: {source}",
        "# One line per source key was printed by `posttrain convert`; check the approximations and unsupported",
        "# keys it lists, point model.name_or_path and the data at local paths, then `posttrain validate` this file.",
        "",
    ]
    order = ["type", "model", "tokenizer", "data", "optimizer", "scheduler"]
    keys = sorted(conv.config, key=lambda k: (order.index(k) if k in order else len(order), k))
    for key in keys:
        for note in conv.comments.get(key, []):
            out.append(f"# {note}")
        out.append(
            yaml.safe_dump({key: conv.config[key]}, sort_keys=False, default_flow_style=False).rstrip()
        )
    return "\n".join(out) + "\n"


def convert_file(path: Path, system: str | None, keep_attention: bool = False) -> Conversion:
    data = read_source(path)
    name = system or detect(data)
    return convert(SYSTEMS[name], data, keep_attention, source=path)


def docs_page(name: str) -> str:
    return rules_markdown(SYSTEMS[name], INTROS[name])


def main(path: Path, system: str | None, out: Path | None, keep_attention: bool = False) -> str:
    conv = convert_file(path, system, keep_attention)
    template = conv.scratch.get("inline_template")
    if template is not None and out is not None:  # the source's inline Jinja, as the file posttrain reads
        where = out.with_suffix(".jinja")
        atomic_write_text(where, template)
        conv.config["tokenizer"]["chat_template"] = str(where)
        conv.line("(tokenizer.chat_template)", SAME, f"the source's inline template written to {where}")
    elif template is not None:
        conv.line(
            "(tokenizer.chat_template)",
            UNSUPPORTED,
            f"an inline template: with -o it is written to a "
            f".jinja file; printing, save it as {INLINE_TEMPLATE} yourself",
        )
    text = render_config(conv, path)
    keys = sum(1 for key, _, _ in conv.lines if not key.startswith("("))
    report = f"converted from {SYSTEMS[conv.system].title}: {keys} source keys\n{render_lines(conv)}"
    if out is None:
        return text + "\n" + "\n".join(f"# {line}" for line in report.splitlines()) + "\n"
    atomic_write_text(out, text)
    return report + f"\nwrote {out}\n"
