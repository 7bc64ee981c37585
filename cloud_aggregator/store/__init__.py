"""The aggregator's state on disk: the SQLite store, its backups and the upload log."""
