"""The fleet over MQTT: rounds (synchronous, buffered, SecAgg), the coordinator and its workers, the singleton lock, the watchdog and the task lanes."""
