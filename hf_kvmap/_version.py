"""The hf-kvmap version (kept apart so that modules below the package root can record it)."""

__version__ = "0.1.0.dev0"
