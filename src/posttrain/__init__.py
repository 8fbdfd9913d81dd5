"""posttrain: fine-tune and post-train LLMs from one YAML file."""

__version__ = "0.1.0"
