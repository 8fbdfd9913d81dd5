"""Where an online run's completions come from: the engine contract (``types.GenerationEngine``), the
keyed draw that makes them reproducible, transformers' ``generate`` on the training weights, and vLLM
(colocated, a server, a pool of servers, LoRA pushes, the worker extension)."""
