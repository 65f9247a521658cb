"""The package version, recorded in every run folder's manifest."""

__version__ = "0.1.0"
