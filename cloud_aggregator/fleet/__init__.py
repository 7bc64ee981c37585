"""Provisioning a fleet: ``fleet init``, its CA, layout, systemd units, plants, and device and worker enrolment."""
