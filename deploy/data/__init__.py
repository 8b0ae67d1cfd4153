"""Data shipped with deploy: the general-text corpus (written for this project)."""
