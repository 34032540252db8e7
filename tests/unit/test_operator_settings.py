"""The operator's settings from its environment (set by the chart)."""

from __future__ import annotations

from rekindle_operator.settings import from_env, image_allowed


def test_allowed_images_exact_and_prefix() -> None:
    pats = ("rekindle.local/runtime-cpu:dev", "registry.example/rekindle/*")
    assert image_allowed("rekindle.local/runtime-cpu:dev", pats)
    assert image_allowed("registry.example/rekindle/runtime-gpu:0.1.0", pats)
    assert not image_allowed("rekindle.local/runtime-cpu:evil", pats)
    assert not image_allowed("registry.example/other/x:1", pats)
    assert image_allowed("anything", ())  # no list: the operator does not restrict


def test_from_env() -> None:
    s = from_env(
        {
            "REKINDLE_ALLOWED_IMAGES": "a:1\nb/*, c:2",
            "REKINDLE_OPERATOR_NAMESPACE": "rk",
            "REKINDLE_OPERATOR_POD_LABELS": "app.kubernetes.io/name=rekindle,"
            "app.kubernetes.io/instance=r",
            "REKINDLE_DELETE_TIMEOUT": "60",
            "REKINDLE_WARM_PLACEMENT": "false",
        }
    )
    assert s.allowed_images == ("a:1", "b/*", "c:2")
    assert s.operator_labels == {
        "app.kubernetes.io/name": "rekindle",
        "app.kubernetes.io/instance": "r",
    }
    assert s.network_policy and s.delete_timeout_s == 60 and s.warm_placement is False
    empty = from_env({})
    assert empty.allowed_images == () and not empty.network_policy
    assert empty.delete_timeout_s == 300 and empty.warm_placement is True
