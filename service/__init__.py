"""prefixserve's HTTP face: aiohttp on uvloop, OpenAI-compatible SSE, a multiplexed WebSocket, metrics, demo page."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("prefixserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
