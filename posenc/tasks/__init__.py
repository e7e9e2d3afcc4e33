"""Thin LightningModules, one per task."""
