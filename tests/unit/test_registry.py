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
