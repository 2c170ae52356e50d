"""What a run reports: metrics rows (JSONL, TensorBoard), metadata.json, the event log,
``mct report`` tables and plots."""
