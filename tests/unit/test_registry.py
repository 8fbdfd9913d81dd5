from __future__ import annotations

import pytest

from posttrain.registry import Registry, UnknownComponentError


def test_register_get_and_did_you_mean() -> None:
    registry: Registry[object] = Registry("widget")

    @registry.register("alpha", config=dict)
    def alpha() -> None: ...

    assert registry.get("alpha").obj is alpha and registry.get("alpha").config is dict
    assert registry.names() == ["alpha"]
    with pytest.raises(UnknownComponentError, match="did you mean 'alpha'") as info:
        registry.get("alpah")
    assert "registered: alpha" in str(info.value)


def test_double_registration_is_refused() -> None:
    registry: Registry[object] = Registry("widget")
    registry.add("a", object(), config=dict)
    with pytest.raises(ValueError, match="already registered"):
        registry.add("a", object(), config=dict)
    registry.add("a", 1, config=dict, replace=True)
    assert registry.get("a").obj == 1


def test_builtins_are_registered_on_first_look_up_and_a_users_replacement_wins() -> None:
    """In a fresh interpreter nothing has imported the built-ins: the first look-up registers them, and a
    user's replace=True made before that look-up is kept (not overwritten by the built-in)."""
    import subprocess
    import sys

    script = (
        "from posttrain.config.model import ModelConfig\n"
        "from posttrain.registry import MODEL_FACTORIES, TRAINERS, LoaderFunction\n"
        "def mine(config, ctx): return None\n"
        "MODEL_FACTORIES.add('huggingface', mine, config=ModelConfig, replace=True)\n"
        "assert 'sft' in TRAINERS.names() and 'liger' in MODEL_FACTORIES\n"
        "entry = MODEL_FACTORIES.get('huggingface')\n"
        "assert isinstance(entry.obj, LoaderFunction) and entry.obj.load is mine\n"
        "assert entry.obj.facts(None) is None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


HOOKS = {
    "loss": "LossBuilder",
    "collator": "CollatorBuilder",
    "prepare": "Prepare",
    "steps": "StepsBuilder",
    "schedule": "Schedule",
    "memory": "MemoryHook",
    "report": "ReportHook",
}


def test_method_hooks_are_protocols_without_any() -> None:
    """Each part of a TrainerSpec is typed by a Protocol whose call names its types (no ``Any``)."""
    import typing

    from posttrain import registry

    fields = typing.get_type_hints(registry.TrainerSpec, vars(registry))  # every name resolves
    for part, protocol_name in HOOKS.items():
        protocol = getattr(registry, protocol_name)
        assert getattr(protocol, "_is_protocol", False), protocol_name
        assert protocol_name in str(fields[part]), (part, fields[part])
        for name in ("__call__",):
            annotations = getattr(protocol, name).__annotations__
            assert annotations and not [a for a in annotations.values() if "Any" in str(a)], protocol_name
    for helper in ("LossFunction", "Collate"):
        annotations = getattr(registry, helper).__call__.__annotations__
        assert not [a for a in annotations.values() if "Any" in str(a)], helper


def test_every_built_in_hook_says_which_hook_it_is() -> None:
    """Where a method implements a hook, its docstring names it (``<part>`` hook)."""
    from posttrain.registry import TRAINERS, load_component

    missing = []
    for name in TRAINERS.names():
        spec = TRAINERS.get(name).obj
        for part in HOOKS:
            ref = getattr(spec, part)
            if ref is None or not isinstance(ref, str) or not ref.startswith("posttrain."):
                continue
            doc = load_component(ref).__doc__ or ""
            if f"``{part}`` hook" not in " ".join(doc.split()):
                missing.append(f"{name}.{part}: {ref}")
    assert not missing, "hooks whose docstring does not name the hook:\n" + "\n".join(missing)
