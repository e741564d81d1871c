"""The configuration plumbing every service imports: recipes (``settings.recipe``), the
command line (``settings.cli``), default locations (``settings.paths``) and ports
(``settings.ports``). It imports no service package and no torch, so every ``--help`` is
instant (docs/RECIPES.md)."""
