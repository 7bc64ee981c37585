"""The pure math of a round: means, second-order heads, reducers, weights, the streaming fold, FedBuff's buffer, the DP accountant and the strategies. No MQTT, no SQLite."""
