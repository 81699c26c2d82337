"""Python client library for chatd (websocket protocol v1)."""

from chatd.client.client import ChatClient, ChatError, ConnectionLost, Reply

__all__ = ["ChatClient", "ChatError", "ConnectionLost", "Reply"]
