"""Capture and restore of training state, and the record layout (below engine and recovery)."""
