"""Building drafts from data: corpus n-gram tables (and, later, distilled draft models)."""
