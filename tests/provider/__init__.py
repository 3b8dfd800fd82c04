"""A simulated model provider for tests: OpenAI Chat Completions, OpenAI Responses and
Anthropic Messages over plain HTTP or HTTPS (`tls.py`), byte-compatible with the captures in
`shared/fixtures/`, scripted one reply per model request.

    from tests.provider import ProviderSimulator, Reply, ToolCall
"""

from .records import Headers, RequestRecord
from .reply import Reply, ToolCall
from .server import ProviderSimulator
from .tls import ServerCert, TestCA

__all__ = ["Headers", "ProviderSimulator", "Reply", "RequestRecord", "ServerCert", "TestCA", "ToolCall"]
