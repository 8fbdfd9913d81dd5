"""Vision-language models: images in rows, the processor that expands them into tokens, image batches for
the model, and what of the model trains (the vision tower, the projector)."""
