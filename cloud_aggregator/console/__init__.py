"""Watching the fleet: the console app, its feed and page, ``fleet status``, the privacy view and the metrics."""
