"""16 concurrent rollouts of a tool agent (the openai SDK), each sealed with its reward.
    python examples/rollouts.py UPSTREAM_BASE_URL KEY_VARIABLE OUT_DIR"""
import asyncio, json, sys
import openai
from interceptor.client import AsyncProxy
from interceptor.scripts import replay_trace

UPSTREAM, KEY_VARIABLE, OUT = sys.argv[1:4]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}

async def rollout(proxy: AsyncProxy, k: int) -> dict:
    a, b = 17 * k % 50, 31 * k % 70
    async with await proxy.session(model="sim-model", upstream="main", task={"a": a, "b": b}) as session:
        client = openai.AsyncOpenAI(api_key=session.secret, http_client=openai.DefaultAsyncHttpxClient(
            proxy=session.proxy_url, verify=session.ssl_context()))
        messages = [{"role": "user", "content": f"What is {a} + {b}? Use the add tool."}]
        while True:  # the agent: call the model, run the tools it asks for, until it answers
            reply = (await client.chat.completions.create(model="any", messages=messages, tools=[ADD])).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
        return await session.close(reward=float(str(a + b) in (reply.content or "")), metrics={"turns": len(messages)})

async def main() -> None:
    async with AsyncProxy(upstreams={"main": {"base_url": UPSTREAM, "api_key_env": KEY_VARIABLE}}, trace_dir=OUT) as proxy:
        results = await asyncio.gather(*(rollout(proxy, k) for k in range(16)))
    replay_trace.main(["export", "--format", "messages", "--out", f"{OUT}/rollouts.jsonl", *(r["trace_path"] for r in results)])
    print(f"{len(results)} rollouts, mean reward {sum(r['reward'] for r in results) / len(results):.2f}")

asyncio.run(main())
