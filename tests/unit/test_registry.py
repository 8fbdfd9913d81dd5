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
