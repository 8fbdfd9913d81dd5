"""The JSON schema of the config file, with every registered component's config.

A typed slot (``model``, ``tokenizer``, ``data``, ``optimizer``, ``scheduler``, ``checkpoint``) accepts the
config of whichever component its ``type:`` names, so its schema is ``anyOf`` the registered configs; the
trainers' own configs (extra top-level keys such as DPO's ``beta``) are listed under ``x-trainers``, the data
sources' configs (``data.sources`` items by ``type:``) under ``x-data-sources``.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from posttrain.config.trainer import TrainerConfig
from posttrain.registry import DATA_SOURCES, SLOT_REGISTRIES, TRAINERS


def config_schema() -> dict[str, Any]:
    slots = {
        slot: [registry.get(n).config for n in registry.names()] for slot, registry in SLOT_REGISTRIES.items()
    }
    trainers = {name: TRAINERS.get(name).config for name in TRAINERS.names()}
    sources = {name: DATA_SOURCES.get(name).config for name in DATA_SOURCES.names()}
    classes = [
        TrainerConfig,
        *trainers.values(),
        *(c for cs in slots.values() for c in cs),
        *sources.values(),
    ]
    classes = list(dict.fromkeys(classes))
    refs, combined = models_json_schema(
        [(cls, "validation") for cls in classes], ref_template="#/$defs/{model}"
    )
    defs = combined["$defs"]
    root_name = refs[(TrainerConfig, "validation")]["$ref"].rsplit("/", 1)[-1]
    root = dict(defs[root_name])
    properties = dict(root["properties"])
    for slot, configs in slots.items():
        choices = {"anyOf": [refs[(cls, "validation")] for cls in configs]}
        field = dict(properties[slot])
        if field.get("type") == "array":
            field["items"] = choices
        else:
            field.pop("$ref", None)
            field.update(choices)
        properties[slot] = field
    root["properties"] = properties
    root["x-trainers"] = {name: refs[(cls, "validation")] for name, cls in trainers.items()}
    root["x-data-sources"] = {name: refs[(cls, "validation")] for name, cls in sources.items()}
    root["$defs"] = defs
    return root
