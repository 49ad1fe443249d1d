"""The OpenAI-compatible HTTP server (`musespark serve`), layered on top of engine/."""
