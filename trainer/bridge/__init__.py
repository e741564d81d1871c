"""trainer/bridge package."""
