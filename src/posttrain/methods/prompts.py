"""The ``prompts`` data type the online methods (grpo, distill) sample from: its stages (``data/prompts.py``)
as a data factory, registered in ``posttrain.builtins``."""

from __future__ import annotations

from posttrain.data.build import DataFactory
from posttrain.data.prompts import COLUMNS, ORIGIN_KEY, fit_prompt, format_prompt_rows

#: the ``prompts`` data factory (registered in ``posttrain.builtins``)
DATA = DataFactory(
    format_batch=format_prompt_rows,
    columns=COLUMNS,
    fit=fit_prompt,
    chat=False,
    not_chat="prompts: completions are sampled and stop at an end-of-turn token",
    origin_key=ORIGIN_KEY,
    revision=2,  # text prompts carry the tokenizer's special tokens (TRL's tokenization)
)
