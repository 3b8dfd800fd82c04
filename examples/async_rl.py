"""Asynchronous RL in miniature: 8 rollouts run through the proxy on one upstream while a
stand-in trainer takes a step every 8 answered turns: it pauses the upstream (new requests
wait at the proxy, the ones already sent finish), swaps the weights, declares the new version
and resumes. Then it reads the finished branches with the version of every sampled token.
    python examples/async_rl.py UPSTREAM_BASE_URL KEY_VARIABLE OUT_DIR"""
import asyncio, collections, sys
import openai
from interceptor.client import AsyncProxy
from interceptor.scripts import replay_trace
from interceptor.trace import read_trace

UPSTREAM, KEY_VARIABLE, OUT = sys.argv[1:4]
ROLLOUTS, TURNS, BATCH, STEPS = 8, 6, 8, 2

async def rollout(proxy: AsyncProxy, k: int, answered: asyncio.Queue) -> str:
    async with await proxy.session(model="policy", upstream="vllm", collect_tokens=True, task={"k": k}) as session:
        client = openai.AsyncOpenAI(api_key=session.secret, http_client=openai.DefaultAsyncHttpxClient(
            proxy=session.proxy_url, verify=session.ssl_context()))
        messages = [{"role": "user", "content": f"Task {k}: work on it step by step."}]
        for _ in range(TURNS):  # a multi-turn conversation; a weight swap may fall between any two turns
            reply = (await client.chat.completions.create(model="any", messages=messages)).choices[0].message
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "Go on."}]
            answered.put_nowait(k)
        return (await session.close(reward=1.0))["trace_path"]

def swap_weights(step: int) -> None:
    """Stand-in for the trainer's update: load the new weights into the inference server here."""

async def trainer(proxy: AsyncProxy, answered: asyncio.Queue) -> None:
    for step in range(1, STEPS + 1):
        for _ in range(BATCH):  # a batch of answered turns to learn from
            await answered.get()
        async with proxy.paused("vllm", version=step + 1) as drain:  # new requests wait; sent ones finish
            assert drain["drained"], drain["running"]
            await asyncio.to_thread(swap_weights, step)

async def main() -> None:
    async with AsyncProxy(upstreams={"vllm": {"base_url": UPSTREAM, "api_key_env": KEY_VARIABLE}}, trace_dir=OUT) as proxy:
        await proxy.set_version("vllm", 1)
        answered: asyncio.Queue = asyncio.Queue()
        training = asyncio.create_task(trainer(proxy, answered))
        paths = await asyncio.gather(*(rollout(proxy, k, answered) for k in range(ROLLOUTS)))
        await training
    tokens: collections.Counter = collections.Counter()
    for path in paths:  # the trainer's view: which weights sampled each token of each branch
        for branch in read_trace(path).branches:
            tokens.update(v for v in branch.policy_versions or [] if v is not None)
    replay_trace.main(["export", "--format", "jsonl", "--out", f"{OUT}/samples.jsonl", *paths])
    print(f"sampled tokens per policy version: {dict(sorted(tokens.items()))}")

asyncio.run(main())
