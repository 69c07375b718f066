"""Command-line interface: `specdec generate|demo|models`."""
