"""Alembic's script directory for the cloud store (env.py, script.py.mako, versions/)."""
