"""Shop-R1 environment: simulated shopping data, prompts, strict parser, hierarchical reward,
evaluation, and the service that turns completions into scored groups (``python -m env_server``)."""
