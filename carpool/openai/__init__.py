"""The OpenAI API as carpool speaks it: the one translation between OpenAI bodies and the engine.

Everything that turns an OpenAI request body into engine requests, or engine output into
an OpenAI response, lives here, once: the server (``carpool serve``), the in-process
backend of ``carpool run``, bench and tune all call it, so a task gets the same answer
whichever way it runs.  Nothing here knows HTTP.

- ``requests``: ``Translator(engine).prepare(kind, body)`` -> ``Prepared`` (validated,
  one ``Choice`` per engine request); ``sampling_params`` (body field -> engine field) and
  the default policy (max_tokens, chat messages).
- ``generation``: ``Generation(engine, prepared.choices)`` runs them and merges the deltas;
  ``engine_failure`` maps an engine exception to its error answer.
- ``responses``: ``ResponseBuilder`` shapes bodies and stream chunks; ``Choice.add`` gathers
  engine output; ``embedding_body`` for ``/v1/embeddings``.
- ``schema`` / ``validation`` / ``openapi``: the request schemas (strict for carpool's engine,
  lenient for any endpoint: ``check_body``), their validator, the ``/openapi.json`` document.
- The error answer itself, ``OpenAIError`` (status + OpenAI error body), is in ``carpool.errors``
  with every other exception carpool defines.
- ``accumulator``: the other direction, for clients: ``StreamAccumulator`` rebuilds the
  non-streamed body from a server's SSE chunks, field for field.

Modules are imported by name (``from carpool.openai.requests import Translator``); this
package file imports nothing, so loading one part does not load the others.
"""
