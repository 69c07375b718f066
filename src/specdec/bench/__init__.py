"""`specdec bench`: every method side by side on the same prompts, in one process."""
