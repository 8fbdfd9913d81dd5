"""M-RoPE positions per document, for the Qwen-VL family's rows laid end to end (packed and padding-free).

A Qwen-VL model gives its image tokens 3-D positions (time, height, width over the image's grid of merged
patches) and the text after an image positions that continue from the image's largest; it computes them itself
(``get_rope_index``) when it is given no ``position_ids``. Rows of several documents must give positions
(restarting at every document), and a Qwen-VL model takes 2-D ``position_ids`` as the same text position on
all three axes: every image token of a packed row would sit on a line instead of its grid, and every token
after it one place off the padded run's. Here each document's positions are the model's own
``get_rope_index`` on that document alone, with that document's images; the text positions the collator made
lead the tensor (``[4, rows, tokens]``, transformers' layout for packed M-RoPE rows), so whatever reads the
documents' bounds from the positions still finds them.

Computed on the host, once per micro-batch (the model's ``get_rope_index`` is a host loop itself).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from posttrain.data.samples import document_bounds


def rope_index_of(model: Any) -> Any:
    """The model's own M-RoPE position function (``get_rope_index``), or None for a model without one."""
    for owner in (model, getattr(model, "model", None)):
        function = getattr(owner, "get_rope_index", None)
        if callable(function):
            return function
    return None


def image_token_counts(model: Any, grids: torch.Tensor) -> list[int]:
    """How many tokens each image of ``image_grid_thw`` stands for in the rows: its patches over the merge."""
    merge = int(getattr(model.config.vision_config, "spatial_merge_size", 1) or 1)
    return (grids.prod(-1) // merge**2).tolist()


def document_mrope_positions(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``position_ids`` ``[4, rows, tokens]`` for rows of several documents (2-D ``position_ids`` restarting
    at 0, ``mm_token_type_ids`` and ``image_grid_thw`` among ``inputs``) of a model with M-RoPE; empty when
    the inputs or the model need none."""
    positions, grids, kinds = (inputs.get(k) for k in ("position_ids", "image_grid_thw", "mm_token_type_ids"))
    rope_index = rope_index_of(model)
    if positions is None or grids is None or kinds is None or positions.dim() != 2 or rope_index is None:
        return {}
    ids, kinds, text, grids = (t.cpu() for t in (inputs["input_ids"], kinds, positions, grids))
    bounds = inputs.get("document_bounds")  # the collator's, on the host; else found from the positions
    bounds = (bounds if bounds is not None else document_bounds(text)["document_bounds"]).tolist()
    per_image = image_token_counts(model, grids)
    flat_ids, flat_kinds = ids.reshape(1, -1), kinds.reshape(1, -1)  # the rows laid end to end, as the bounds
    out = text.reshape(1, -1).repeat(3, 1)
    image = 0
    for a, b in itertools.pairwise(bounds):
        tokens, first = int((flat_kinds[0, a:b] == 1).sum()), image
        while tokens > 0:
            if image >= len(per_image):
                raise ValueError("the rows hold more image tokens than their images stand for")
            tokens -= per_image[image]
            image += 1
        if tokens < 0:
            raise ValueError("an image's tokens are split between two documents")
        if image > first:
            found, _ = rope_index(
                flat_ids[:, a:b], mm_token_type_ids=flat_kinds[:, a:b], image_grid_thw=grids[first:image]
            )
            out[:, a:b] = found[:, 0]
    if image != len(per_image):
        raise ValueError(f"{len(per_image)} images for the image tokens of {image}")
    out = out.view(3, *text.shape)
    return {"position_ids": torch.cat([text.unsqueeze(0), out]).to(positions.device)}


def with_modality_inputs(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with what a vision-language model reads beyond its ids and images, derived from them: the
    per-token modality types (``collate.token_types``) and, for rows of several documents, the M-RoPE
    positions per document. A text model's inputs as they are."""
    from posttrain.vision.collate import token_types

    types = token_types(model, inputs["input_ids"])
    if not types:
        return inputs
    inputs = inputs | types
    return inputs | document_mrope_positions(model, inputs)
