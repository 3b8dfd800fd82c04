"""The Trace: canonical messages, the message graph, and its msgpack record stream.

Imports nothing else of ours: dialects and addons depend on this package, never the reverse.
"""

from interceptor.trace._version import VERSION
from interceptor.trace.messages import (
    Choice,
    Message,
    Part,
    Reasoning,
    Request,
    Response,
    ResponseError,
    Sampling,
    Tool,
    ToolCall,
    Usage,
    canonical_json,
    message_hash,
)
from interceptor.trace.model import (
    MIN_SCHEMA_VERSION,
    SCHEMA_VERSION,
    Branch,
    Header,
    MessageNode,
    ModelCall,
    Override,
    ReplaySource,
    Rewrite,
    Trace,
)
from interceptor.trace.records import (
    ChecksumWarning,
    HoleWarning,
    TornRecordWarning,
    TraceFormatError,
    TraceVersionError,
    iter_records,
    read_trace,
    record_schema,
)
from interceptor.trace.follow import Follower, Sealed, TurnLanded, follow_traces
from interceptor.trace.recorder import Recorder
from interceptor.trace.store import FSYNC_POLICIES, Store, TraceExistsError

__all__ = [
    "Branch", "ChecksumWarning", "Choice", "FSYNC_POLICIES", "Follower", "Header", "HoleWarning", "MIN_SCHEMA_VERSION", "Message",
    "MessageNode", "Sealed", "TurnLanded", "follow_traces",
    "ModelCall", "Override", "ReplaySource", "Part", "Reasoning", "Recorder", "Request", "Response", "ResponseError", "Rewrite",
    "SCHEMA_VERSION", "Sampling", "Store", "Tool", "ToolCall", "TornRecordWarning", "Trace",
    "TraceExistsError", "TraceFormatError", "TraceVersionError", "Usage", "VERSION", "canonical_json", "iter_records",
    "message_hash", "read_trace", "record_schema",
]
