"""Deployment checks, run by hand as root and not by ``make test``: the device side on an emulated
Raspberry Pi root (``make pi-check``, ``python -m deploy.pi_check``) and the systemd units under a
real systemd (``make services-check``, ``python -m deploy.services_check``).  ``grafana/`` holds the
dashboard operators import.  Their tests (tests/deploy/) render reports from given figures.
"""
