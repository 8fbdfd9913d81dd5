"""posttrain: fine-tune and post-train LLMs from one YAML file."""

from posttrain.utils.imports import quiet_torchao_import

__version__ = "0.1.0"

quiet_torchao_import()
