"""The HTTP gateway: ModelForge for clients that do not speak Temporal, including any built on
the OpenAI SDK (`/v1/embeddings`, `/v1/chat/completions`). `gateway_server` runs it with header,
body and keep-alive timeouts; docs/SECURITY.md says what it defends."""

from modelforge.gateway._app import GatewayConfig, create_app, load_api_keys
from modelforge.gateway._errors import http_status
from modelforge.gateway._observe import log_level_from_env
from modelforge.gateway._server import gateway_server, run_gateway

__all__ = [
    "GatewayConfig",
    "create_app",
    "gateway_server",
    "http_status",
    "load_api_keys",
    "log_level_from_env",
    "run_gateway",
]
