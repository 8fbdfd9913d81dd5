"""Reward models: a causal LM's backbone with a scalar score head.

``load_sequence_classifier`` is transformers' ``AutoModelForSequenceClassification`` with one label for every
architecture transformers maps; for one it does not map (a model with remote code, say), the same layout is
built on the model's own pretrained class with transformers' generic sequence-classification head (a
``score`` linear layer on the last hidden state), so training and export work alike. The score of a sequence
is read at its last token that is not padding (transformers' pooling; posttrain pads on the right), so an
export scores conversations exactly as it was trained to.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.errors import UserError
from posttrain.models.huggingface import HuggingFaceModelFactory
from posttrain.vision.processor import is_vision_language


def _generic_classifier(name_or_path: str, config: Any, **arguments: Any) -> Any:
    """The architecture's pretrained class with transformers' generic score head on top."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import GenericForSequenceClassification

    with torch.device("meta"):  # only its class is wanted: no weights allocated
        causal = AutoModelForCausalLM.from_config(
            config, trust_remote_code=arguments.get("trust_remote_code", False)
        )
    pretrained = next(
        cls
        for cls in type(causal).__mro__
        if cls.__name__.endswith("PreTrainedModel") and cls is not type(causal)
    )
    name = f"{type(causal).__name__.removesuffix('ForCausalLM')}ForSequenceClassification"
    classifier = type(name, (GenericForSequenceClassification, pretrained), {})
    del causal
    return classifier.from_pretrained(name_or_path, num_labels=1, **arguments)


def load_sequence_classifier(name_or_path: str, generic: bool = False, **arguments: Any) -> Any:
    """``name_or_path`` as a one-label sequence classifier (``generic``: always build the generic head)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    config = AutoConfig.from_pretrained(
        name_or_path, trust_remote_code=arguments.get("trust_remote_code", False)
    )
    if is_vision_language(config):
        raise UserError(
            f"{name_or_path} is a vision-language model: reward models with an image encoder are not supported "
            "yet; train the reward model on a text model, or score images with a reward function"
        )
    if generic or config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        model = _generic_classifier(name_or_path, config, **arguments)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(name_or_path, num_labels=1, **arguments)
    return model


def sequence_scores(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """One float32 score per row (the head's value at the row's last real token)."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask") if k in batch}
    return model(**inputs, use_cache=False).logits[:, 0].float()


def set_pad_token(model: Any, pad_token_id: int) -> None:
    """The pooling finds each row's last real token by the pad id: the collator's, also in the export."""
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    target.config.pad_token_id = pad_token_id


#: the ``sequence-classification`` model factory (registered in ``posttrain.builtins``)
FACTORY = HuggingFaceModelFactory(load_sequence_classifier)
