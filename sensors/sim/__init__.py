"""Machine simulators: printers and welders with realistic per-machine domain shifts."""
