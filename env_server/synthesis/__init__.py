"""Rationale synthesis pieces (``python -m env_server.synthesize``; docs/SYNTHESIS.md): the
request (``prompt``), the answer rule (``rule``), the resume cache (``cache``), the endpoint
client (``endpoint``) and the options (``config``)."""
