"""``cloud-aggregator console``'s choices before it serves: where it binds and what token it wants."""

from __future__ import annotations

import pytest

from cloud_aggregator.console.cli import check_token, is_loopback, url
from ioft_protocol.config import ConfigError


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("127.0.0.2", True), ("0.0.0.0", False),
     ("::", False), ("10.0.0.5", False), ("printers.example", False)],
)  # fmt: skip
def test_only_loopback_addresses_count_as_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_a_token_is_made_off_loopback_and_kept_when_given():
    assert check_token("127.0.0.1", None) is None
    made = check_token("0.0.0.0", None)
    assert made is not None and len(made) >= 32 and made != check_token("0.0.0.0", None)
    assert check_token("0.0.0.0", "s3cret") == "s3cret"
    assert check_token("127.0.0.1", "s3cret") == "s3cret"  # asked for on loopback: required there too
    with pytest.raises(ConfigError, match="--token"):
        check_token("0.0.0.0", "  ")


def test_url_names_the_token_and_brackets_ipv6():
    assert url("0.0.0.0", 8765, "t") == "http://0.0.0.0:8765/?token=t"
    assert url("::1", 80, None) == "http://[::1]:80/"


def test_a_rounds_held_out_scores_reach_the_page_by_the_curves_metric():
    from cloud_aggregator.console.fleet_view import _round_json
    from cloud_aggregator.rounds.types import RoundRecord

    rec = RoundRecord("speed", 2, "train", "completed", ["p1"], {"p1": 9}, {"p1": {"test_loss": 0.2}}, {},
                      "h", 0.0, 1.0, {"holdout": {"p3": {"loss": 0.25, "accuracy": 1.0}, "p4": "junk"}})  # fmt: skip
    assert _round_json(rec, "test_loss")["holdout"] == {"p3": 0.25}
    assert _round_json(rec, None)["holdout"] == {}
