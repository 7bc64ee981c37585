"""Every topic of the fleet is built by ``ioft_protocol.topics``: no module of the cloud, the device or
the shared protocol writes an ``ioft/v1/...`` topic by hand, and the ACL ``fleet init`` writes grants exactly the
topics those builders make."""

from __future__ import annotations

import ast
from pathlib import Path

from cloud_aggregator.fleet.acl import acl_text
from ioft_protocol import topics

ROOT = Path(__file__).resolve().parents[2]
#: The packages that speak MQTT (sensors and trainer_lite speak none).
PACKAGES = ("cloud_aggregator", "edge", "export", "ioft_protocol")


def _hand_built(path: Path) -> list[int]:
    """Lines of ``path`` holding an f-string that starts a topic from ``PROTOCOL`` or a literal ``ioft/v1/``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            named = isinstance(first, ast.FormattedValue) and ast.unparse(first.value).endswith("PROTOCOL")
            literal = isinstance(first, ast.Constant) and str(first.value).startswith("ioft/v1/")
            if named or literal:
                lines.append(node.lineno)
    return lines


def test_no_topic_is_built_by_hand_outside_topics_py():
    found = {
        f"{p.relative_to(ROOT)}:{line}"
        for package in PACKAGES
        for p in sorted((ROOT / package).rglob("*.py"))
        if p != ROOT / "ioft_protocol" / "topics.py"
        for line in _hand_built(p)
    }
    assert not found, f"build these with ioft_protocol.topics: {sorted(found)}"


def test_the_acl_grants_the_topics_the_builders_make():
    acl = acl_text("f", ["d1"], workers=["w1"]).splitlines()
    any_ = topics.ANY
    for line in (
        f"topic write {topics.topic_up('f', any_, 'd1')}",
        f"topic write {topics.topic_stats('f', any_, 'd1')}",
        f"topic read {topics.topic_scaling_all('f')}",
        f"topic read {topics.topic_stats_all('f')}",
        f"topic readwrite {topics.topic_scaling_all('f')}",
        f"topic read {topics.topic_secagg_down('f', any_, 'd1')}",
        f"topic read {topics.topic_model_chunk_all('f')}",
        f"topic readwrite {topics.topic_aggregator_lock('f')}",
        f"topic write {topics.topic_agg_batch('f', any_, 'w1')}",
        f"topic readwrite {topics.topic_models('f')}",
    ):
        assert line in acl
