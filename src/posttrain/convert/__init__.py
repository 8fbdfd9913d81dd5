"""``posttrain convert``: configs of other training systems (SiloGen, ERNIEKit, Megatron-Bridge) as posttrain
configs, with one line per source key saying where it went, how it was approximated, or why it is not
supported. Each system is a table of rules (``silogen.py``, ``erniekit.py``, ``megatron_bridge.py``); the
same tables generate ``docs/from-<system>.md``."""
