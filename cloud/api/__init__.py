"""The cloud's HTTP API (FastAPI): OpenAI-compatible inference plus the operator endpoints."""
from apiary.cloud.api.app import AppContext, create_app

__all__ = ["AppContext", "create_app"]
