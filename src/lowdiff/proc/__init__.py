"""Background processes: spawning, the trainer-to-process link and its typed protocol."""
