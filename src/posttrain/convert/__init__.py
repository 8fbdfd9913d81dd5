"""``posttrain convert``: configs of other training systems (SiloGen, ERNIEKit, Megatron-Bridge, TRL, Axolotl,
LLaMA-Factory) as posttrain configs, with one line per source key saying where it went, how it was
approximated, or why it is not supported. Each system is a table of rules (``silogen.py``, ``erniekit.py``,
``megatron_bridge.py``, ``trl.py``, ``axolotl.py``, ``llama_factory.py``; the ``TrainingArguments`` keys
several share in ``hf_args.py``); the same tables generate ``docs/from-<system>.md``."""

#: the systems ``--from`` names (the command line is built without importing the tables; a test keeps this
#: equal to ``run.SYSTEMS``)
SYSTEM_NAMES = ("silogen", "erniekit", "megatron-bridge", "trl", "axolotl", "llama-factory")
