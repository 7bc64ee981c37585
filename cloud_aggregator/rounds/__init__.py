"""The round engine and what it shares with its fleets: admission, stragglers, the buffered loop and the in-process simulation. No MQTT, no SQLite."""
