"""The OpenAI-compatible agent endpoint: an agent program's chat calls served by a rollout engine.

- :mod:`.openai_server`: the endpoint (``/v1/chat/completions``, ``/v1/completions``) over one engine.
- :mod:`.record`: what the endpoint recorded of each call (prompt and completion token ids,
  log-probs, weight versions) and the training samples built from those tokens.
- :mod:`.runner`: runs agent programs against the endpoint and collects their episodes.

Nothing is imported here (docs/agents.md).
"""
