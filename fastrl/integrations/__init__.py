"""Adapters from other trainers' loss settings to fastrl's `LossConfig` (import them by name:
`fastrl.integrations.trl`; nothing here imports the trainer libraries themselves)."""
