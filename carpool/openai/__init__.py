"""The OpenAI wire format in both directions: request bodies to engine requests, engine output to bodies and chunks."""
