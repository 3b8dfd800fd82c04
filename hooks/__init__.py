"""``interceptor.hooks``: what an evaluator's hooks module imports.

    from interceptor.hooks import HookContext, Request, Response, intercept, stop

The public face of ``interceptor.trace.hooks`` (where the decorators and the context live,
beside the canonical ``Request`` and ``Response`` they are annotated with, so the trace
package stays free of the proxy): importing it pulls in no addon and no mitmproxy, so a hooks
file can be imported and unit-tested on its own.
"""

from interceptor.trace.hooks import HookContext, HookError, intercept, stop
from interceptor.trace.messages import Message, Part, ReadOnly, Request, Response

__all__ = ["HookContext", "HookError", "Message", "Part", "ReadOnly", "Request", "Response", "intercept", "stop"]
