"""The run's middle: the one training loop and its seams. ``loop`` (optimizer steps, evaluation, records,
checkpoints, stops), ``steps`` (where each step's micro-batches come from), ``extras`` (what other parts add to
a step: observers, step extras), ``stops`` (kill switch, signals, time limit), ``engine`` (the DeepSpeed
adapter the loop drives) and ``profiling`` (the observers that profile steps)."""
