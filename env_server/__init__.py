"""env_server package."""
