"""OpenAI-compatible HTTP server over the engine (``carpool serve``).

``start_server(ServerConfig(...))`` runs it in a background thread and yields a handle
with ``base_url``; ``start_server_process(argv)`` runs ``carpool serve`` as a subprocess.
"""

from carpool.server.app import build_app
from carpool.server.config import ServerConfig
from carpool.server.launcher import ServerHandle, start_server, start_server_process

__all__ = ["ServerConfig", "ServerHandle", "build_app", "start_server", "start_server_process"]
