"""tests/http/fastapi_app.py with the one-line ASGI integration of the marker package."""

from fastapi_app import app  # noqa: F401  (uvicorn imports this module from tests/http)
from mcp_hostagent_marker.asgi import MarkRequests

marked = MarkRequests(app)
