"""``teralm serve``: the model and its index behind an OpenAI-compatible HTTP API."""
