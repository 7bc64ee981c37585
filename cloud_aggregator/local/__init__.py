"""Running a fleet on one machine: the demo, the local fleet launcher, the broker and RabbitMQ helpers."""
