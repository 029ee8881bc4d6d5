"""The OpenAI-compatible HTTP server: `aioengine serve`."""
