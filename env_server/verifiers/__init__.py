"""verifiers (v1) environments served to the batching API (docs/VERIFIERS.md)."""
