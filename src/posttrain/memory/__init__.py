"""Will it fit? The memory plan of a run, computed before any weight is read.

``shape`` counts the model from its ``config.json`` on the meta device; ``estimate`` turns a config, that
shape and a world size into itemised bytes per GPU and per host; ``machine`` says what a machine has (found,
or described on the command line); ``fixes`` finds the cheapest changes that make a plan fit; ``report``
prints a plan; ``check`` is the stage ``train`` runs before loading the model.
"""
