"""The tokenmux Python client: completions and chat, whole or streamed, with exact timings,
over HTTP (outside the cluster) or a Serve handle (inside); transports.py holds the two
transports."""
from deploy.client.tokenmux_client import (AsyncTokenmuxClient, Completion, StreamChunk, TokenmuxClient,
                                           TokenmuxError, Usage)

__all__ = ["AsyncTokenmuxClient", "Completion", "StreamChunk", "TokenmuxClient", "TokenmuxError", "Usage"]
