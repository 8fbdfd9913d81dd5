"""posttrain's methods on vLLM's workers (``worker_extension_cls``, for the colocated engine and for the server
``posttrain vllm-serve`` starts): the weight push, checked.

vLLM reloads weights in place layer by layer, and a layer that receives none of its weights keeps what it had:
the LM head of a model whose head is its input embedding (tied: Qwen2.5 up to 3B, Llama 3.2 1B/3B, Gemma,
SmolLM2) receives no weight of its own, since the checkpoint holds the embedding once. Its weight is the
embedding's tensor, refreshed with it, but what the layer prepared from it when it loaded (on a CPU, the
matrix packed for oneDNN or the small-GEMM kernels) stays the old weights', so the engine samples from a head
that is not the trained one. :meth:`PosttrainWorker.posttrain_reload` reloads, prepares every tied layer
again from its refreshed weight, and reports any other layer that took no weight, which the trainer treats as
an error. Imported by vLLM in its worker processes: vLLM's own modules only, no training code."""

from __future__ import annotations

import logging
from typing import Any

#: vLLM's logger that says a layer received none of its weights in a reload
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED = ": Failed to load weights"
#: layers with no weights of their own to load, which vLLM's reload mentions anyway: the rotary tables;
#: beside them, every class whose layers hold buffers only (:func:`buffer_only_layers`: the image
#: normalisation vLLM builds from the processor's mean and std, Gemma 3's embedding scale)
WEIGHTLESS = ("RotaryEmbedding",)


class _Failed(logging.Filter):
    """Records the class names of the layers a reload says took no weights, and keeps the lines of ``quiet``
    classes (the tied layers, which ``posttrain_reload`` prepares again) from the log."""

    def __init__(self, quiet: set[str]) -> None:
        super().__init__()
        self.quiet, self.names = quiet, []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.endswith(FAILED):
            return True
        name = message[: -len(FAILED)]
        self.names.append(name)
        return name not in self.quiet


def tied_layers(model: Any) -> dict[str, Any]:
    """Layers whose every parameter belongs to a layer named before them (a tied LM head): name -> layer."""
    owner: dict[int, str] = {}
    tied = {}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own and all(id(p) in owner for p in own):
            tied[name] = module
        for parameter in own:
            owner.setdefault(id(parameter), name)
    return tied


def buffer_only_layers(model: Any) -> set[str]:
    """The classes whose every layer holds tensors but no parameter of its own: buffers vLLM computes when it
    builds the model (Gemma 3's embedding scale, SigLIP's position ids), which no checkpoint holds and a reload
    reports as not loaded."""
    holds: dict[str, bool] = {}
    for module in model.modules():
        name = type(module).__name__
        own = any(True for _ in module.parameters(recurse=False))
        buffers = any(True for _ in module.buffers(recurse=False))
        if own or buffers:
            holds[name] = holds.get(name, False) or own
    return {name for name, parameters in holds.items() if not parameters}


class PosttrainWorker:
    """Mixed into vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def posttrain_reload(
        self, weights_iterator: Any = None, weights_path: str | None = None, tag: str | None = None
    ) -> dict[str, list[str]]:
        """Reload the weights in place (an iterator of ``(name, tensor)``, or a checkpoint directory), prepare
        tied layers again, and return ``{"refreshed": [...], "missing": [...]}``: the tied layers prepared
        again, and the classes of the other layers that took no weight. ``tag`` names the weights (a pool's
        servers: :meth:`posttrain_tag` says which weights a server holds)."""
        self.posttrain_weights = None  # mid-reload: no weights anyone may sample from
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        tied = tied_layers(model)
        quiet = (
            {type(layer).__name__ for layer in tied.values()} | set(WEIGHTLESS) | buffer_only_layers(model)
        )
        failed = _Failed(quiet)
        logger = logging.getLogger(RELOAD_LOGGER)
        logger.addFilter(failed)
        try:
            self.model_runner.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=weights_iterator, weights_path=weights_path, is_checkpoint_format=True
            )
        finally:
            logger.removeFilter(failed)
        for layer in tied.values():
            method = getattr(layer, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(layer)
        self.posttrain_weights = tag
        return {"refreshed": list(tied), "missing": sorted(set(failed.names) - failed.quiet)}

    def posttrain_tag(self) -> str | None:
        """The tag of the weights this worker holds (None: the files' weights, or a reload in progress)."""
        return getattr(self, "posttrain_weights", None)
