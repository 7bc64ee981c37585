"""Each `cloud-aggregator` command logs under its own name: the operator's
tools beside `serve` are told apart from the aggregator in a shared log."""

from __future__ import annotations

from cloud_aggregator.cli import build_parser, log_name


def test_each_command_logs_under_its_own_name():
    names = {
        tuple(argv): log_name(build_parser().parse_args(argv))
        for argv in (["serve", "--config", "a.toml"], ["console"], ["push", "m.onnx"], ["fleet", "status"])
    }
    assert names == {
        ("serve", "--config", "a.toml"): "aggregator",
        ("console",): "console",
        ("push", "m.onnx"): "push",
        ("fleet", "status"): "fleet-status",
    }
