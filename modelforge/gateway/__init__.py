"""The HTTP gateway: ModelForge for clients that do not speak Temporal, including any built on
the OpenAI SDK (`/v1/embeddings`, `/v1/chat/completions`)."""

from modelforge.gateway._app import GatewayConfig, create_app, load_api_keys
from modelforge.gateway._errors import http_status

__all__ = ["GatewayConfig", "create_app", "http_status", "load_api_keys"]
