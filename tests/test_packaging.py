"""pyproject.toml as setuptools reads it: no deprecation warning (each one is a line of `make demo`)."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement

setuptools = pytest.importorskip("setuptools")
from setuptools.config.pyprojecttoml import apply_configuration  # noqa: E402
from setuptools.dist import Distribution  # noqa: E402

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_license_is_an_spdx_string_that_setuptools_reads_without_a_warning():
    meta = tomllib.loads(PYPROJECT.read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    # the SPDX form needs setuptools 77 (PEP 639); an older build backend would refuse it
    (backend,) = [Requirement(r) for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert "76.9" not in backend.specifier and "77.0" in backend.specifier
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a SetuptoolsDeprecationWarning fails the test
        dist = apply_configuration(Distribution(), PYPROJECT)
    assert dist.metadata.license_expression == "Apache-2.0"
