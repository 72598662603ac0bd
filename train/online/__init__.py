"""The online trainer: Ray actors that read records from the stream, distil the draft, checkpoint,
ack, export, gate and publish to the registry (trainer.py); what differs per draft family
(family.py); the bound on lag (lag.py); replay of recent records after a shift (replay.py);
telemetry (metrics.py). Imports gate/ and distill/ (and infra/), never warm/ or teacher/."""
