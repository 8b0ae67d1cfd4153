"""The store's schema revisions, oldest first by ``down_revision``."""
