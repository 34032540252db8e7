"""Rekindle operator: InferenceService and Checkpoint reconciliation (kopf)."""
