"""The configuration plumbing every service imports (docs/RECIPES.md); no torch, no service."""
