"""The OpenAI-compatible server: settings (config), HTTP routes (app), continuous batching (batcher), metrics, and
running it (server.serve). Nothing is imported here, so reading the settings loads no web framework."""
