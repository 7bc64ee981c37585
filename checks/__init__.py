"""Checks the suite drives and a person may run longer by hand: the fleet's fault scenarios
(``fault_scenarios``: the e2e tests assert on each run, ``benchmarks.reliability`` repeats and
counts them) and the decoders of untrusted bytes under mutation (``python -m checks.fuzz_decoders``).

They import no benchmark but its results-file plumbing (``benchmarks.common``), so a study may run them.
"""
