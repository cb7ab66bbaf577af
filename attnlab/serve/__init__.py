"""`attnlab serve`: an OpenAI-compatible HTTP server over a generation engine."""
