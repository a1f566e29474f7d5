"""Errors of the runtime (torch-free, so the CLI can catch them without importing torch)."""


class ArtifactError(ValueError):
    """An artifact that cannot be used: missing, corrupt, tampered, foreign or from a newer schema."""
