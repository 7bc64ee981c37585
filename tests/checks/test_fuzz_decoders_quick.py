"""Every decoder of untrusted bytes, fuzzed with hypothesis on a CI budget (seconds).

The contract (see ``checks.fuzz_decoders``): return a valid object or raise the
documented error type; nothing else, no hangs.  ``python -m checks.fuzz_decoders``
runs the large budget.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checks.fuzz_decoders import Target, Workdir, all_targets, check_one, fuzz, mutate
from tests.budget import examples


def _names() -> list[str]:
    work = Workdir()
    try:
        return [t.name for t in all_targets(work)]
    finally:
        work.close()


NAMES = _names()
SETTINGS = settings(
    max_examples=examples(40),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module")
def targets() -> Iterator[dict[str, Target]]:
    work = Workdir()
    try:
        yield {t.name: t for t in all_targets(work)}
    finally:
        work.close()


@pytest.mark.parametrize("name", NAMES)
def test_seeds_decode(targets, name):
    target = targets[name]
    for data in target.seeds:
        assert check_one(target, data) is None


@pytest.mark.parametrize("name", NAMES)
def test_mutated_and_structured_inputs_keep_the_contract(targets, name):
    target = targets[name]

    @SETTINGS
    @given(rnd=st.randoms(use_true_random=False), structured=st.booleans())
    def check(rnd: random.Random, structured: bool) -> None:
        if structured and target.structured is not None:
            data = target.structured(rnd)
        else:
            data = mutate(rnd.choice(target.seeds), rnd, target.seeds)
        finding = check_one(target, data, hang_s=2.0)
        assert finding is None, f"{finding.kind}: {finding.error}\n{finding.trace}"

    check()


@pytest.mark.parametrize("name", NAMES)
def test_arbitrary_bytes_keep_the_contract(targets, name):
    target = targets[name]

    @SETTINGS
    @given(data=st.binary(max_size=512))
    def check(data: bytes) -> None:
        finding = check_one(target, data, hang_s=2.0)
        assert finding is None, f"{finding.kind}: {finding.error}\n{finding.trace}"

    check()


def test_the_harness_reports_crashes_and_hangs():
    """A decoder that breaks the contract must be caught (so a green run means something)."""

    def fragile(data: bytes) -> None:
        if data[:1] == b"{":
            raise KeyError("boom")
        if data[:1] == b"}":
            while True:
                pass
        raise ValueError("bad")

    t = Target("fragile", fragile, (ValueError,), [b"x{}", b"{"])
    assert check_one(t, b"x") is None
    assert check_one(t, b"{").kind == "crash"
    assert check_one(t, b"}", hang_s=0.2).kind == "hang"
    tally = fuzz(t, 50, seed=0, hang_s=0.2)
    assert tally.inputs == 50 and any(f.kind == "crash" for f in tally.findings)


def test_mutate_is_bounded_and_deterministic():
    a = [mutate(b"seed" * 100, random.Random(3), [b"other"], max_size=64) for _ in range(2)]
    assert a[0] == a[1] and len(a[0]) <= 64
